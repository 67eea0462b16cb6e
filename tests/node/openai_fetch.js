// The OpenAI-compatible HTTP API from Node.js with nothing but fetch: stream a completion over SSE.
// usage: node openai_fetch.js BASE_URL API_KEY PROMPT MAX_TOKENS
// prints one JSON line: {"text", "events", "done", "finish_reason"}
const [base, key, prompt, maxTokens] = process.argv.slice(2);

async function main() {
  const res = await fetch(`${base}/v1/completions`, {
    method: "POST",
    headers: { "content-type": "application/json", authorization: `Bearer ${key}` },
    body: JSON.stringify({ prompt, max_tokens: Number(maxTokens), temperature: 0, stream: true }),
  });
  if (res.status !== 200) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
  const decoder = new TextDecoder();
  let buffer = "";
  let text = "";
  let events = 0;
  let done = false;
  let finish = null;
  for await (const chunk of res.body) {
    buffer += decoder.decode(chunk, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (!event.startsWith("data: ")) throw new Error(`not an SSE data event: ${event}`);
      const data = event.slice(6);
      if (data === "[DONE]") {
        done = true;
        continue;
      }
      const msg = JSON.parse(data);
      events += 1;
      for (const c of msg.choices) {
        text += c.text;
        if (c.finish_reason) finish = c.finish_reason;
      }
    }
  }
  console.log(JSON.stringify({ text, events, done, finish_reason: finish }));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
