"""End to end: the `openai` package against `infermesh up`, compared with transformers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from tests.e2e.conftest import Mesh, json_call

pytestmark = pytest.mark.e2e

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three colors."]
MAX = 32
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.http}/v1", api_key="unused", max_retries=0, timeout=300)


# n and lists of prompts (issue 19): their checks compare texts across requests, which float32 engines give the
# same in any batch.  First in the module: their requests all go to one engine, whose P99 then weighs against it
# in balancing for the engines' 10 s window (test_routing.py, next, counts on equal engines).
def test_n_choices_share_one_prefill_and_seeds_repeat(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You are a storyteller who writes short, vivid tales for children."},
                {"role": "user", "content": "Tell me a story about a brave little fox in the snowy forest."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, n=4, temperature=1.0, seed=11,
                                           max_tokens=24)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in reply.choices}) > 1          # seed + j: different choices
    prompt = reply.usage.prompt_tokens
    per_choice = reply.model_extra["infermesh"]["choices"]  # type: ignore[index]
    replicas = {c["replica"] for c in per_choice}
    assert len(replicas) == 1                                            # the followers went to the leader's
    assert all(c["cached_tokens"] >= prompt - 16 for c in per_choice[1:]), per_choice   # prefilled once
    again = client.chat.completions.create(model=MODEL, messages=messages, n=4, temperature=1.0, seed=11,
                                           max_tokens=24)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, n=4, temperature=1.0, seed=11,
                                                 max_tokens=24, stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(4)]
    assert texts == [c.message.content for c in reply.choices]


def test_list_of_prompts_with_echo(client: openai.OpenAI) -> None:
    prompts = ["The capital of France is", "Two plus two equals"]
    reply = client.completions.create(model=MODEL, prompt=prompts, n=2, temperature=0, max_tokens=6, echo=True)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for c in reply.choices:
        assert c.text.startswith(prompts[c.index // 2]) and len(c.text) > len(prompts[c.index // 2])
    assert reply.choices[0].text == reply.choices[1].text            # greedy: the same twice
    alone = client.completions.create(model=MODEL, prompt=prompts[1], temperature=0, max_tokens=6)
    assert reply.choices[2].text == prompts[1] + alone.choices[0].text
    streamed = [""] * 4
    for c in client.completions.create(model=MODEL, prompt=prompts, n=2, temperature=0, max_tokens=6, echo=True,
                                       stream=True):
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert streamed == [c.text for c in reply.choices]
    # echo with logprobs: the prompt's own tokens first (the first has none); max_tokens 0 scores the prompt alone
    scored = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompts[1] and "".join(lp.tokens) == prompts[1]
    assert lp.token_logprobs[0] is None and all(v < 0 for v in lp.token_logprobs[1:])
    assert scored.usage.completion_tokens == 0 and scored.choices[0].finish_reason == "length"
    full = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=6, echo=True, logprobs=1,
                                     temperature=0)
    lp2, k = full.choices[0].logprobs, len(lp.tokens)
    assert lp2.tokens[:k] == lp.tokens and lp2.text_offset[k] == len(prompts[1])
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp2.token_logprobs[1:k], lp.token_logprobs[1:], strict=True))
    assert "".join(lp2.tokens[k:]) == alone.choices[0].text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_chat_equals_transformers(client: openai.OpenAI, reference, prompt: str) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": prompt}]
    expected = reference(MAX, messages=messages)
    reply = client.chat.completions.create(model="smollm2-135m", messages=messages, temperature=0, max_tokens=MAX)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    meta = reply.model_extra["infermesh"]  # type: ignore[index]
    assert meta["replica"] in ("engine-0", "engine-1") and meta["degraded"] is False
    assert meta["confidence"] == 1.0 and meta["model_version"] and meta["region"] == "local"

    stream = client.chat.completions.create(model="smollm2-135m", messages=messages, temperature=0,
                                            max_tokens=MAX, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert chunks[-1].model_extra["infermesh"]["replica"] in ("engine-0", "engine-1")  # type: ignore[index]


def test_greedy_completion_equals_transformers(client: openai.OpenAI, reference) -> None:  # type: ignore[no-untyped-def]
    prompt = "The three primary colors are"
    expected = reference(16, prompt=prompt)
    reply = client.completions.create(model="smollm2-135m", prompt=prompt, temperature=0, max_tokens=16)
    assert reply.choices[0].text == expected
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2-135m", prompt=prompt, temperature=0, max_tokens=16, stream=True) if c.choices)
    assert streamed == expected


def test_round_robin_uses_both_engines(client: openai.OpenAI) -> None:
    seen = set()
    for _ in range(4):
        reply = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=2)
        seen.add(reply.model_extra["infermesh"]["replica"])  # type: ignore[index]
    assert seen == {"engine-0", "engine-1"}


def test_pinned_replica_and_seeded_sampling(client: openai.OpenAI) -> None:
    texts = set()
    for _ in range(2):
        reply = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "Tell me a story."}], temperature=1.0,
            seed=77, max_tokens=12, extra_headers={"x-infermesh-replica": "engine-1"})
        assert reply.model_extra["infermesh"]["replica"] == "engine-1"  # type: ignore[index]
        texts.add(reply.choices[0].message.content)
    assert len(texts) == 1


def test_stop_string_ends_the_answer(client: openai.OpenAI, reference) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = reference(MAX, messages=messages)
    assert "Paris" in full
    reply = client.chat.completions.create(model="smollm2-135m", messages=messages, temperature=0,
                                           max_tokens=MAX, stop=["Paris"])
    assert reply.choices[0].message.content == full[: full.index("Paris")]
    assert reply.choices[0].finish_reason == "stop"


def test_models_health_and_metrics(client: openai.OpenAI, mesh: Mesh) -> None:
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    with urllib.request.urlopen(f"{mesh.http}/health") as reply:
        assert reply.status == 200
    with urllib.request.urlopen(f"{mesh.http}/metrics") as reply:
        assert b"infermesh_edge_requests_total" in reply.read()
    with urllib.request.urlopen(f"http://127.0.0.1:{mesh.engine_metrics_port}/metrics") as reply:
        text = reply.read().decode()
    for name in ("infermesh_engine_requests_running", "infermesh_engine_kv_blocks_free",
                 "infermesh_engine_prefix_hit_tokens_total", "infermesh_engine_step_seconds",
                 "infermesh_engine_generated_tokens_total", "infermesh_engine_time_to_first_token_seconds",
                 "infermesh_engine_time_per_output_token_seconds"):
        assert f'{name}' in text and 'replica="engine-0"' in text


def test_repeated_prefix_is_served_from_the_prefix_cache(client: openai.OpenAI) -> None:
    document = "Infermesh serves language models as a mesh of small services. " * 40
    messages = [{"role": "system", "content": document}, {"role": "user", "content": "Summarize."}]
    pinned = {"x-infermesh-replica": "engine-0"}
    first = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=4, temperature=0,
                                           extra_headers=pinned)
    second = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=4, temperature=0,
                                            extra_headers=pinned)
    assert first.usage is not None and second.usage is not None
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached >= second.usage.prompt_tokens - 16 and cached > 400
    assert second.choices[0].message.content == first.choices[0].message.content


def test_precise_errors(client: openai.OpenAI, mesh: Mesh) -> None:
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="context of 8192 tokens"):
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.NotFoundError, match="replica 'engine-7' does not exist"):
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "x"}],
                                       extra_headers={"x-infermesh-replica": "engine-7"})
    with pytest.raises(openai.BadRequestError, match="context is 8192 tokens"):
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "hello " * 9000}])
    with pytest.raises(openai.BadRequestError, match="'top_p' must be between 0 and 1"):
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "x"}], top_p=2)
    request = urllib.request.Request(f"{mesh.http}/v1/chat/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request)
    assert err.value.code == 400
    body = json.loads(err.value.read())
    assert body["error"]["type"] == "invalid_request_error" and "not valid JSON" in body["error"]["message"]
    # The mesh still serves after all of that.
    ok = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=2)
    assert ok.choices[0].message.content is not None


def post(mesh: Mesh, path: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    return json_call(mesh, "POST", path, body, timeout=60)


def test_tokenize_and_detokenize_agree_with_transformers(mesh: Mesh, client: openai.OpenAI, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """POST /tokenize and /detokenize (vLLM's shapes): the ids transformers' tokenizer gives, the count a
    completion is charged, and text back from ids."""
    text = "Tokenizers split words like 'unbelievable' into pieces."
    status, body = post(mesh, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert status == 200, body
    assert body["tokens"] == hf_tokenizer.encode(text, add_special_tokens=True) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(body["tokens"])
    assert body["max_model_len"] > 0 and body["model"] == MODEL
    status, back = post(mesh, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == hf_tokenizer.decode(body["tokens"]), back

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    status, chat = post(mesh, "/tokenize", {"messages": messages})       # model absent: the default
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert status == 200 and chat["tokens"] == hf_tokenizer.encode(rendered, add_special_tokens=False), chat
    assert chat["token_strs"] is None
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage   # type: ignore[arg-type]
    assert usage is not None and usage.prompt_tokens == chat["count"]
    status, back = post(mesh, "/detokenize", {"tokens": chat["tokens"]})
    assert status == 200 and back["prompt"] == rendered                   # special tokens kept: the template
    status, open_turn = post(mesh, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert status == 200 and chat["tokens"][:open_turn["count"]] == open_turn["tokens"] < chat["tokens"]

    refused = [({"prompt": text, "messages": messages}, 400, "exactly one of"),
               ({"messages": messages, "add_special_tokens": True}, 400, "add_special_tokens"),
               ({"prompt": text, "add_generation_prompt": True}, 400, "add_generation_prompt"),
               ({"prompt": text, "model": "no-such-model"}, 404, "no-such-model")]
    for request, code, words in refused:
        status, answer = post(mesh, "/tokenize", request)
        assert status == code and words in answer["error"]["message"], (request, answer)
    status, answer = post(mesh, "/detokenize", {"tokens": [1, 10**9]})
    assert status == 400 and "outside the vocabulary" in answer["error"]["message"], answer
    status, answer = post(mesh, "/detokenize", {"tokens": [1, -2]})
    assert status == 400 and answer["error"]["param"] == "tokens[1]", answer


EMBED = ["The cat sat on the mat.", "A cat was sitting on the mat.", "Stock markets fell sharply on Tuesday.",
         "How do I bake bread at home?", "What is the recipe for homemade bread?",
         "The spacecraft entered orbit around Mars.", "Interest rates were raised by the central bank.",
         "My favourite colour is blue."]
PARAPHRASES = ((0, 1), (3, 4))


def test_embeddings_are_normalized_pooled_states_where_a_paraphrase_is_nearest(  # type: ignore[no-untyped-def]
        mesh: Mesh, client: openai.OpenAI, hf) -> None:
    """client.embeddings.create (the openai package asks for base64): 8 inputs, each the mean of transformers'
    final hidden states scaled to length 1; each paraphrase is its sentence's nearest neighbour."""
    import torch

    model, tokenizer = hf
    reply = client.embeddings.create(model=MODEL, input=EMBED)
    vectors = torch.tensor([d.embedding for d in reply.data])
    assert [d.index for d in reply.data] == list(range(8)) and vectors.shape == (8, model.config.hidden_size)
    assert torch.allclose(vectors.norm(dim=1), torch.ones(8), atol=1e-5)
    ids = [tokenizer.encode(t) for t in EMBED]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, ids))
    with torch.inference_mode():
        mean = model.model(torch.tensor([ids[0]])).last_hidden_state[0].float().mean(0)
    assert torch.allclose(vectors[0], mean / mean.norm(), atol=1e-4)
    cosine = vectors @ vectors.T - 2 * torch.eye(8)          # self-similarity out of the way
    for a, b in PARAPHRASES:
        assert int(cosine[a].argmax()) == b and int(cosine[b].argmax()) == a, cosine

    floats = client.embeddings.create(model=MODEL, input=[ids[0]], encoding_format="float")   # token ids in
    assert torch.allclose(torch.tensor(floats.data[0].embedding), vectors[0], atol=1e-6)
    short = client.embeddings.create(model=MODEL, input=EMBED[0], dimensions=64).data[0].embedding
    assert len(short) == 64 and torch.allclose(torch.tensor(short), vectors[0, :64] / vectors[0, :64].norm(),
                                               atol=1e-5)
    for body, param in (({"model": MODEL, "input": ""}, "input[0]"),
                        ({"model": MODEL, "input": "x", "dimensions": 1000}, "dimensions"),
                        ({"model": MODEL, "input": "x", "encoding_format": "int8"}, "encoding_format")):
        status, answer = post(mesh, "/v1/embeddings", body)
        assert status == 400 and answer["error"]["param"] == param, answer
    status, answer = post(mesh, "/v1/embeddings", {"model": "no-such-model", "input": "x"})
    assert status == 404, answer
    status, answer = post(mesh, "/v1/embeddings", {"model": MODEL, "input": [[1, 2], [3, 10**9]]})
    assert status == 400 and "outside the vocabulary" in answer["error"]["message"], answer


# The request vocabulary (issue 50): vLLM's truncate_prompt_tokens and bad_words, added to mesh/sampling.py and
# the message only, reach the router (truncation, the words' token ids) and the engine (the ban) through the
# conversions derived from it.
LONG_PROMPT = ("The history of the lighthouse keeper begins on a small rocky island, far from the mainland, where "
               "the winter storms arrive without warning and the nights are long. Every evening he climbs the stairs")


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=LONG_PROMPT, temperature=0, max_tokens=4)
    assert whole.usage is not None and whole.usage.prompt_tokens > 20
    cut = client.completions.create(model=MODEL, prompt=LONG_PROMPT, temperature=0, max_tokens=4,
                                    extra_body={"truncate_prompt_tokens": 12})
    assert cut.usage is not None and cut.usage.prompt_tokens == 12
    chunks = list(client.completions.create(model=MODEL, prompt=LONG_PROMPT, temperature=0, max_tokens=4,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"truncate_prompt_tokens": 12}))
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].prompt_tokens == 12
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG_PROMPT}],
                                          temperature=0, max_tokens=4, extra_body={"truncate_prompt_tokens": 9})
    assert chat.usage is not None and chat.usage.prompt_tokens == 9
    # Shorter than the limit: unchanged.
    short = client.completions.create(model=MODEL, prompt=LONG_PROMPT, temperature=0, max_tokens=4,
                                      extra_body={"truncate_prompt_tokens": 100_000})
    assert short.usage is not None and short.usage.prompt_tokens == whole.usage.prompt_tokens
    assert short.choices[0].text == whole.choices[0].text
    with pytest.raises(openai.BadRequestError, match="'echo' returns the whole prompt"):
        client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4, echo=True,
                                  extra_body={"truncate_prompt_tokens": 5})
    with pytest.raises(openai.BadRequestError, match="'truncate_prompt_tokens' must be between 1 and"):
        client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4,
                                  extra_body={"truncate_prompt_tokens": 0})


def test_bad_words_are_never_generated(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    free = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12)
    words = free.choices[0].text.split()
    assert words, free.choices[0].text
    word = words[0].strip(".,")
    banned = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12,
                                       extra_body={"bad_words": [word]})
    assert word not in banned.choices[0].text.split()[:1], (word, banned.choices[0].text)
    assert banned.choices[0].text != free.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stream=True, extra_body={"bad_words": [word]})
        if c.choices)
    assert streamed == banned.choices[0].text
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    chat_free = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
    first = (chat_free.choices[0].message.content or "").split()[0].strip(".,")
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,
                                          extra_body={"bad_words": [first]})
    assert first not in (chat.choices[0].message.content or "").split()[:1]
    chat_streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=8, stream=True, extra_body={"bad_words": [first]})
        if c.choices)
    assert chat_streamed == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="'bad_words' must be a string or a list of strings"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"bad_words": [3]})
