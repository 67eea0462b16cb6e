// A Node.js client for llmserve, with stubs made at run time from proto/ by @grpc/proto-loader.
//
//   node stream_generate.js 127.0.0.1:50051 "Once upon a time" [max_tokens] [json_schema]
//
// Streams one greedy generation (constrained to the JSON schema when one is given), printing each text delta as it arrives on stderr and, at the end,
// one JSON line on stdout: {"text", "token_ids", "finish_reason", "usage", "messages"}.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "proto");

function loadGeneration() {
  const definition = protoLoader.loadSync("llmserve/v1/generation.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as in the .proto (max_tokens, token_ids)
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).llmserve.v1;
}

function main() {
  const [target, prompt, maxTokens, jsonSchema] = process.argv.slice(2);
  if (!target || prompt === undefined) {
    console.error("usage: node stream_generate.js HOST:PORT PROMPT [MAX_TOKENS]");
    process.exit(2);
  }
  const llmserve = loadGeneration();
  const client = new llmserve.Generation(target, grpc.credentials.createInsecure());
  const request = {
    text: prompt,
    temperature: 0,
    max_tokens: Number(maxTokens || 16),
    return_token_ids: true,
  };
  if (jsonSchema) {
    request.json_schema = jsonSchema; // the `constraint` oneof: structured output
  }
  const result = { text: "", token_ids: [], finish_reason: null, usage: null, messages: 0 };
  const call = client.GenerateStream(request, { deadline: Date.now() + 60000 });
  call.on("data", (msg) => {
    result.messages += 1;
    result.text += msg.text;
    result.token_ids.push(...msg.token_ids);
    process.stderr.write(msg.text);
    if (msg.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
      result.finish_reason = msg.finish_reason;
      result.usage = msg.usage;
    }
  });
  call.on("error", (err) => {
    console.error(`\nerror: ${err.code} ${err.details}`);
    process.exit(1);
  });
  call.on("end", () => {
    process.stdout.write(JSON.stringify(result) + "\n");
    client.close();
  });
}

main();
