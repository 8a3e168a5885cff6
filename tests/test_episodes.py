"""common/rollout/episodes.py: a trajectory's ids are the chat template's rendering of its conversation, built by appending
(never re-encoding what the model generated); observation tokens are masked out of every loss; episodes through the
HF engine: masks and observations where they belong, and a one-turn environment samples exactly what the
single-turn path samples."""

import os
import pickle
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AddedToken, PreTrainedTokenizerFast

import launcher
from common.data.synthetic import LookupEnv
from common.rollout.episodes import ChatFormat, MultiTurn, with_tools_described
from common.rollout.tools import calculator, tool_schema
from common.train.tiny_model import NUM_VALUES, build_tiny_tokenizer
from gloo import finish_gloo, free_port, init_gloo

# The tool parts of Qwen2.5-Instruct's chat template (its system message for tools, assistant turns, tool messages
# merged into one user turn), as in the model's tokenizer_config.json.
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


def byte_tokenizer(template: str | None = QWEN_TEMPLATE) -> PreTrainedTokenizerFast:
    """A byte-level BPE without merges (any text encodes, one token per byte) with Qwen's chat tokens: the special
    <|im_start|> / <|im_end|>, and <tool_call> / </tool_call> as added tokens that are not special (decoding with
    skip_special_tokens keeps them, as Qwen2.5's does)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    fast.chat_template = template
    return fast


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("template", [QWEN_TEMPLATE, None], ids=["qwen-template-with-tools", "plain-text"])
def test_a_trajectory_is_the_template_rendering_of_its_conversation(template):
    """Prompt, a turn with two tool calls that stops at </tool_call> (so the template's <|im_end|> is an observation
    token), the two tool messages (merged into one user turn by the template), a turn ending at <|im_end|> with a
    third call, its result, and the answer: the ids built turn by turn equal the rendering of the whole conversation
    (the last turn's <|im_end|> included; the template then adds "\\n")."""
    tokenizer = byte_tokenizer(template)
    chat, tools = ChatFormat(tokenizer, use_template=template is not None), [tool_schema(calculator)]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    turns = [call % "12*34" + call % "1+1", "Next: " + call % "408*2", "It is 816."]
    ended_by = ["</tool_call>", "<|im_end|>", "<|im_end|>"]
    results = [[calculator("12*34"), calculator("1+1")], [calculator("408*2")]]
    opening = [{"role": "user", "content": "What is 12 * 34 * 2?"}]

    ids, mask = chat.opening_ids(opening, tools), []
    prompt_len = len(ids)
    conversation = list(opening)
    for i, text in enumerate(turns):
        generated = encode(tokenizer, text) if ended_by[i] == "</tool_call>" else \
            encode(tokenizer, text) + [tokenizer.convert_tokens_to_ids(ended_by[i])]
        ids, mask = ids + generated, mask + [1] * len(generated)
        conversation.append({"role": "assistant", "content": text})
        if i < len(results):
            messages = [{"role": "tool", "content": r} for r in results[i]]
            observation = chat.observation_ids(messages, tools, generated)
            ids, mask = ids + observation, mask + [0] * len(observation)
            conversation += messages
    if template is not None:
        whole = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=True, return_dict=False)
        assert ids == list(whole[:len(ids)]) and tokenizer.decode(whole[len(ids):]) == "\n"
        assert tokenizer.decode([t for t, m in zip(ids[prompt_len:], mask) if m == 0]).count("<tool_response>") == 3
    else:  # contents between blank lines, after the turn as generated (a plain-text prompt: common/data/prompts.py)
        prompt = "\n\n".join(m["content"] for m in with_tools_described(opening, tools))
        ends = ["", "<|im_end|>", "<|im_end|>"]
        observations = ["\n\n" + "\n\n".join(r) + "\n\n" for r in results] + [""]
        assert tokenizer.decode(ids) == prompt + "".join(t + e + o for t, e, o in zip(turns, ends, observations))
    # What the model generated is in the trajectory exactly as generated, and nothing else is marked as its own.
    own = tokenizer.decode([t for t, m in zip(ids[prompt_len:], mask) if m == 1], skip_special_tokens=True)
    assert own == "".join(turns)


def test_a_template_that_rewrites_history_is_refused():
    tokenizer = byte_tokenizer("{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="only appends"):
        ChatFormat(tokenizer, use_template=True).observation_ids([{"role": "tool", "content": "4"}], [], [65])


def test_tools_are_described_where_the_template_cannot_render_them():
    tokenizer = byte_tokenizer("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = ChatFormat(tokenizer, use_template=True)
    text = tokenizer.decode(chat.opening_ids([{"role": "user", "content": "Q"}], [tool_schema(calculator)]))
    assert text.startswith("<|im_start|>system\nYou can call these tools:\n{\"name\": \"calculator\"")
    assert '<tool_call>{"name": "...", "arguments": {...}}</tool_call>' in text


# ---------------------------------------------------------------------------------------------------------------
# Episodes through the HF engine on the built-in tiny model.

ONE_TURN_ENV = '''
from common.data.synthetic import synthetic_reward

class OneTurn:
    def __init__(self, row):
        self.row = row

    def step(self, reply):
        return [], synthetic_reward(self.row["prompt"], reply, self.row["answer"]), True

def make_env(row):
    return OneTurn(row)
'''


def episode_args(**overrides) -> SimpleNamespace:
    return SimpleNamespace(**{
        "chat_template": None, "env": "lookup", "tools": None, "reward_fn": "synthetic", "env_timeout": 60.0,
        "reward_workers": 1, "prompt_template": None, "system_prompt": None, "group_size": 4, "max_turns": 4,
        "max_turn_len": 1, "max_prompt_len": 16, "max_response_len": 6, "temperature": 1.0, "top_p": 1.0,
        **overrides})


def run_episodes_worker(rank: int, world: int, port: int, out_dir: str, env_file: str) -> None:
    """Lookup episodes with the built-in model, and the same prompts through a one-turn environment and through
    the single-turn path (generate + the reward), from the same seed."""
    from common.data.prompts import load_train_eval, tokenize_prompts
    from common.rollout.engines import HFRolloutEngine
    from common.rollout.rewards import RewardScorer
    from common.rollout.generate import sample_batch, scored_samples
    from common.train.model import load_model, load_tokenizer

    init_gloo(rank, world, port)
    tokenizer = load_tokenizer(None)
    model = load_model(None, tokenizer, seed=0)
    rows, _ = tokenize_prompts(load_train_eval(None, "prompt", "answer")[0][:6], tokenizer, 16)
    engine = HFRolloutEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, rank)
    lookup = MultiTurn(episode_args(), tokenizer)
    episodes = lookup.sample(engine, rows, seed=3, logprobs=True)
    lookup.close()
    one_turn = MultiTurn(episode_args(env=f"{env_file}:make_env", max_turn_len=None, max_response_len=2), tokenizer)
    args = episode_args(group_size=4, max_response_len=2, seed=0, tis_cap=None, logprob_diff_every=1)
    scorer = RewardScorer("synthetic", None, 1)
    multi, _ = scored_samples(rows, sample_batch(engine, scorer, one_turn, tokenizer, rows, args, step=5), scorer,
                              one_turn, version=4)
    single, _ = scored_samples(rows, sample_batch(engine, scorer, None, tokenizer, rows, args, step=5), scorer, None,
                               version=4)
    one_turn.close()
    scorer.close()
    with open(os.path.join(out_dir, "out.pkl"), "wb") as f:
        pickle.dump({"episodes": episodes, "multi": multi, "single": single, "rows": rows}, f)
    finish_gloo()


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("episodes")
    (tmp / "one_turn.py").write_text(ONE_TURN_ENV)
    launcher.spawn(run_episodes_worker, args=(1, free_port(), str(tmp), str(tmp / "one_turn.py")), nprocs=1)
    with open(tmp / "out.pkl", "rb") as f:
        return pickle.load(f)


def test_lookup_episodes_mask_the_observations(episodes):
    """Every turn that is not a number is a lookup, followed by one observation token, the hidden number, masked 0
    with log-prob 0; every other token is the model's own (mask 1); an episode that ends by itself is scored by its
    answer; one cut by a limit is truncated."""
    tokenizer = build_tiny_tokenizer()
    numbers = {tokenizer.convert_tokens_to_ids(str(n)) for n in range(NUM_VALUES)}
    observations = 0
    for row, group in zip(episodes["rows"], episodes["episodes"]):
        hidden = tokenizer.convert_tokens_to_ids(LookupEnv(row).value)
        for e in group:
            assert len(e.response_ids) == len(e.response_mask) == len(e.logprobs) <= 6
            assert e.turns == sum(e.response_mask) <= 4
            for i, (token, own) in enumerate(zip(e.response_ids, e.response_mask)):
                if not own:
                    observations += 1
                    assert (token, e.logprobs[i]) == (hidden, 0.0)
                    assert e.response_mask[i - 1] == 1 and e.response_ids[i - 1] not in numbers
            cut_at_a_lookup = e.truncated and e.response_ids[-1] not in numbers
            assert e.tool_calls == e.response_mask.count(0) + cut_at_a_lookup
            if not e.truncated:
                assert e.response_ids[-1] in numbers
                assert e.reward == float(tokenizer.convert_ids_to_tokens(e.response_ids[-1]) == row["answer"])
    assert observations > 0


def test_a_one_turn_environment_samples_what_the_single_turn_path_does(episodes):
    """Same prompts, same seed: identical responses, log-probs, rewards and flags, with a mask of ones."""
    multi, single = episodes["multi"], episodes["single"]
    assert len(multi) == len(single) == 24
    for m, s in zip(multi, single):
        assert m["response_ids"] == s["response_ids"] and m["logprobs"] == s["logprobs"]
        assert (m["reward"], m["finished"], m["version"]) == (s["reward"], s["finished"], s["version"])
        assert m["response_mask"] == [1] * len(s["response_ids"]) and m["turns"] == 1
