"""What a real checkpoint brings must not change what the maths assumes: its generation_config
(sampling settings, extra stop ids), a chat template that thinks, and a user's bad input. Each test
edits a copy of the tiny model's folder the way Qwen2.5-Instruct or Qwen3 ship theirs."""
import json
import shutil

import pytest
import torch

import grpo
import passk
import rse_search
import sampling_evolve
import w2spo
from conftest import CHAT_TEMPLATE

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
    assert "the prompt opens <think>" in capsys.readouterr().err
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
