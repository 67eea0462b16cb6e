"""The offline API as vLLM users write it: strings or token ids in, text and tokens out, stop
strings matched on text outside the engine core."""

from __future__ import annotations

import pytest

from engine_svc import LLM, SamplingParams
from tests.engine_helpers import assert_pool_whole


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(model=str(default_model_dir), max_num_batched_tokens=256, num_kv_blocks=128)


def test_seed_examples_run_as_written(default_model_dir):
    llm = LLM(model=str(default_model_dir), tensor_parallel_size=1, num_kv_blocks=64)
    outs = llm.generate(
        ["Hello, my name is", "def fib(n):"],
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=512, stop=["<|im_end|>"]),
        use_tqdm=False,
    )
    assert len(outs) == 2 and all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    llm2 = LLM(
        model=str(default_model_dir),
        enable_prefix_caching=True,
        max_num_batched_tokens=4096,
        num_kv_blocks=64,
    )
    assert llm2.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    assert_pool_whole(llm.engine)


def test_text_is_the_decode_of_the_tokens(llm):
    outs = llm.generate(
        ["The quick brown fox", "你好，世界", "😀 emoji"],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        use_tqdm=False,
    )
    tok = llm.get_tokenizer()
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 24 and c.finish_reason == "length"
        assert c.text == tok.decode(c.token_ids)
        assert o.prompt_token_ids == tok.encode(o.prompt)
    assert_pool_whole(llm.engine)


def test_token_id_prompts_and_order(llm):
    prompts = [[100, 200, 300], [5] * 40, [7]]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert [o.prompt_token_ids for o in outs] == prompts
    one = llm.generate(
        [5] * 40, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert one[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert one[0].num_cached_tokens == 32  # the 40-token prompt's two full blocks were cached


def test_stop_string_cuts_text_and_finishes(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    free = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    # A stop string taken from the middle of the free-running text, spanning several characters.
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    cut = free.text.index(stop)
    out = llm.generate(
        "Once upon a time",
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:cut]
    assert len(out.token_ids) < len(free.token_ids)
    inc = llm.generate(
        "Once upon a time",
        SamplingParams(
            temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert inc.text == free.text[: cut + len(stop)]
    assert_pool_whole(llm.engine)


def test_parallel_sampling_outputs(llm):
    outs = llm.generate(
        "Tell me", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in outs[0].outputs)
    assert_pool_whole(llm.engine)


def test_string_prompt_without_tokenizer_is_refused(tiny_llama, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_llama / f, bare / f)
    llm = LLM(model=str(bare), num_kv_blocks=16)
    with pytest.raises(ValueError, match="string prompts need a tokenizer"):
        llm.generate("text", use_tqdm=False)
    assert llm.generate([[4, 5]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_dummy_load_format_needs_only_config(tmp_path, tiny_llama):
    import shutil

    shutil.copy(tiny_llama / "config.json", tmp_path / "config.json")
    llm = LLM(model=str(tmp_path), load_format="dummy", num_kv_blocks=16)
    out = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    from engine_svc.models import arch

    with pytest.raises(ValueError, match="supported: ") as refused:
        LLM(model=str(tmp_path), load_format="dummy")
    listed = str(refused.value).split("supported: ", 1)[1].split(", ")
    assert listed == sorted(arch.names()) and {"LlamaForCausalLM", "Qwen3MoeForCausalLM"} <= set(listed)


# --- LLM.chat ---------------------------------------------------------------------------------


def test_chat_one_conversation_or_many(llm):
    tok = llm.get_tokenizer()
    first = [{"role": "user", "content": "Hello there"}]
    second = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 <|im_start|>"}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    one = llm.chat(first, params, use_tqdm=False)
    both = llm.chat([first, second], params, use_tqdm=False)
    assert len(one) == 1 and len(both) == 2
    # the gateway's chat encoding: a special token's string inside a message stays plain text
    assert both[1].prompt_token_ids == tok.apply_chat_template(second)
    # three turns opened by the template (system, user, the generation prompt); the user's is text
    assert both[1].prompt_token_ids.count(tok.token_to_id("<|im_start|>")) == 3
    assert one[0].prompt == tok.render_chat(first)
    # a chat is exactly a generate over the template's ids
    ids = llm.generate([tok.apply_chat_template(first)], params, use_tqdm=False)[0].outputs[0].token_ids
    assert one[0].outputs[0].token_ids == both[0].outputs[0].token_ids == ids
    assert_pool_whole(llm.engine)


def test_chat_with_a_template_of_its_own_and_without_generation_prompt(llm):
    template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    messages = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.chat(messages, params, chat_template=template, use_tqdm=False)[0]
    assert out.prompt == "[user] hi\n[assistant] "
    assert out.prompt_token_ids == llm.get_tokenizer().encode(
        "[user] hi\n[assistant] ", add_special_tokens=False
    )
    plain = llm.chat(messages, params, add_generation_prompt=False, use_tqdm=False)[0]
    assert plain.prompt == "<|im_start|>user\nhi<|im_end|>\n"


def test_chat_refuses_bad_messages_and_token_only_models(llm, tiny_llama, tmp_path):
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="a conversation"):
        llm.chat([], params, use_tqdm=False)
    with pytest.raises(ValueError, match="has no 'content'"):
        llm.chat([{"role": "user"}], params, use_tqdm=False)
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_llama / f, bare / f)
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        LLM(model=str(bare), num_kv_blocks=16).chat([{"role": "user", "content": "x"}], params)
    assert_pool_whole(llm.engine)


def test_chat_renders_tools_into_the_prompt(llm):
    from pathlib import Path

    template = (
        Path(__file__).resolve().parent / "chat_templates" / "tool_chat_template_hermes.jinja"
    ).read_text()
    tools = [
        {"type": "function", "function": {"name": "get_time", "description": "Clock.", "parameters": {}}}
    ]
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.chat(messages, params, chat_template=template, tools=tools, use_tqdm=False)[0]
    assert '"name": "get_time"' in out.prompt and "<tools>" in out.prompt
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in out.prompt
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(messages, True, template, tools=tools)
    without = llm.chat(messages, params, chat_template=template, use_tqdm=False)[0]
    assert "<tools>" not in without.prompt


def test_offline_prompt_chunks_beside_decodes_take_the_whole_budget(default_model_dir):
    """Offline, nobody reads a token before ``generate`` returns: a long prompt's chunks beside
    running decodes get the step's whole work budget, not the served default's decode stall cap
    (with the cap, 16-20 tokens a step here; without it, over 100)."""
    llm = LLM(model=str(default_model_dir), max_num_batched_tokens=256, num_kv_blocks=128)
    assert llm.engine.scheduler.stall_factor == 0
    sched = llm.engine.scheduler
    plan, steps = sched.schedule, []

    def schedule():
        out = plan()
        steps.append(
            [
                (len(s.token_ids) - s.num_computed_tokens, n)
                for s, n in zip(out.seqs, out.num_new, strict=True)
            ]
        )
        return out

    sched.schedule = schedule
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    short, long = [7, 8, 9, 10], [(5 + 13 * i) % 1000 + 3 for i in range(1200)]
    outs = llm.generate([short, long], params, use_tqdm=False)
    beside = [
        max(n for left, n in step if left > 1)
        for step in steps
        if any(left == 1 for left, _ in step) and any(left > 1 for left, _ in step)
    ]
    assert len(beside) >= 3 and min(beside[:-1]) > 100, beside
    # the same tokens as each prompt alone (the plan never changes a row's bits)
    alone = LLM(model=str(default_model_dir), max_num_batched_tokens=256, num_kv_blocks=128)
    for prompt, out in zip([short, long], outs, strict=True):
        solo = alone.generate([prompt], params, use_tqdm=False)[0]
        assert solo.outputs[0].token_ids == out.outputs[0].token_ids
    capped = LLM(
        model=str(default_model_dir), max_num_batched_tokens=256, num_kv_blocks=128, decode_stall_factor=3.0
    )
    assert capped.engine.scheduler.stall_factor == 3.0
    assert_pool_whole(llm.engine)


def test_offline_steps_seat_every_running_sequence(default_model_dir):
    """Offline, nobody reads a token before ``generate`` returns: every running sequence takes each
    step (vLLM's offline batch is max_num_seqs wide), not the server's CPU seats (16 a thread,
    docs/slow-readers.md), which would leave the rest to sit steps out."""
    import torch

    from engine_svc.config import EngineConfig
    from engine_svc.engine import seqs_per_step

    served = seqs_per_step(EngineConfig(model=str(default_model_dir)), torch.device("cpu"))
    # more sequences than the served seats (where threads are few enough for those to be < 256)
    num = min(served + 8, 256)
    llm = LLM(model=str(default_model_dir), max_num_batched_tokens=2048, num_kv_blocks=num * 2 + 8)
    sched = llm.engine.scheduler
    plan, widths = sched.schedule, []

    def schedule():
        out = plan()
        widths.append(len(out.seqs))
        return out

    sched.schedule = schedule
    prompts = [[3 + (7 * i + j) % 500 for j in range(5)] for i in range(num)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert max(widths) == num, (widths, served)
    assert sched.max_per_step == 256
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    # the same tokens as a prompt alone (a row's bits do not depend on the step's width)
    for i in (0, num - 1):
        solo = llm.generate([prompts[i]], params, use_tqdm=False)[0]
        assert solo.outputs[0].token_ids == outs[i].outputs[0].token_ids
    served_llm = LLM(
        model=str(default_model_dir), num_kv_blocks=16, max_seqs_per_step=None, decode_stall_factor=None
    )
    assert served_llm.engine.scheduler.max_per_step == served
    assert_pool_whole(llm.engine)
