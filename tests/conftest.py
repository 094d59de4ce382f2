"""Shared fixtures: the repo root on sys.path and a tiny random-weight model built offline; the order
of the tests for `-n 2` (pytest-xdist: two workers, as CI and the README run the suite)."""
import gc
import os
import string
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# vLLM's CPU build sizes its KV cache from --gpu-memory-utilization x the memory node's size minus this
# process's size, which other tests (and the other worker) make unpredictable: a fixed KV cache, in GiB.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "3")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread a worker (and its subprocesses): two workers
    os.environ["OMP_NUM_THREADS"] = "1"     # on two cores, not four threads fighting for them

# The real-model runs are most of the suite's time: they go first, the longest with the shortest to
# one worker, the other two to the other, then the engines' runs (TRL: two processes for Pass@k, the
# rescue of SamplingEvolve) and compare.py; the rest as a worker is free.
LONG = ["test_learning.py::test_w2spo_trains_the_branches_of_both_models",
        "test_learning.py::test_an_update_pushes_better_completions_up_and_worse_down[grpo]",
        "test_learning.py::test_sampling_evolve_evolves_the_all_wrong_groups",
        "test_learning.py::test_an_update_pushes_better_completions_up_and_worse_down[passk]",
        "test_engines.py::test_sampling_evolve_on_trl_rescues_a_group",
        "test_engines.py::test_passk_on_trl_two_processes",
        "test_compare.py::test_compare_quick_end_to_end"]


def pytest_configure(config):
    """-n 2 deals the tests one at a time (xdist's default deals chunks of consecutive tests, which
    could queue two long runs on one worker); the first two tests go to each worker. The marker
    `cuda`: tests for a machine with CUDA (skipped without; `python -m pytest tests/ -m cuda`)."""
    config.addinivalue_line("markers", "cuda: needs CUDA (python -m pytest tests/ -m cuda)")
    if getattr(config.option, "maxschedchunk", "absent") is None:
        config.option.maxschedchunk = 1


@pytest.fixture(autouse=True)
def no_vllm_engine_outlives_its_test():
    """A vLLM engine that a run left behind shuts vLLM's process-wide state down whenever the
    garbage collector gets to it, which breaks any engine made after it in the same worker. Once
    vLLM is loaded, each test's engines are collected before the next test starts."""
    yield
    if "vllm" in sys.modules:
        gc.collect()


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("/")[-1], len(LONG)))  # stable

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model(folder, seed=0, eos="<|im_end|>"):
    """A 2-layer Llama (head_dim 64, as vLLM's CPU attention needs) with a character-level
    tokenizer and a ChatML chat template; eos = pad = <|im_end|> like SmolLM2. Saved to `folder`.
    eos="<|endoftext|>" builds a base-style checkpoint, as Qwen's base models ship: its EOS is not
    the token that ends a turn in its chat template (one more token in the vocabulary)."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"] + ([eos] if eos != "<|im_end|>" else [])
    vocab = {tok: i for i, tok in enumerate(specials + list(string.printable))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token a character
    backend.decoder = decoders.Fuse()  # join characters without spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<|im_start|>",
                                        eos_token=eos, pad_token=eos,
                                        additional_special_tokens=["<|im_end|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=vocab[eos], pad_token_id=vocab[eos], tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


def keep_applied_gradients(model, optimizer):
    """train_step frees the gradients after its last optimizer step; a test that inspects them calls
    this first and then restore() puts back each weight's .grad as that step applied it."""
    applied = {}
    optimizer.register_step_pre_hook(lambda *_: applied.update({p: p.grad for p in model.parameters()}))

    def restore():
        for p, grad in applied.items():
            p.grad = grad
    return restore
