"""The log-probs in chunks (the shared plumbing's token_logprobs and hidden_logprobs) against the
implementation they replaced, kept below as the reference: equal log-probs, entropies and gradients
in fp32 and under bf16 autocast, on the tiny test model and on models of other architectures; and
what the backward pass keeps, per completion token, at a real vocabulary."""
import pytest
import torch

import grpo

FP32_LOGP, FP32_GRAD = 1e-5, 1e-4  # the tolerances asked of the chunks (relative for gradients)


def reference_token_logprobs(model, ids, attention_mask, num_completion_tokens, temperature,
                             micro_batch, with_entropy=False, compute_dtype=torch.float32):
    """grpo.token_logprobs before the chunks (commit 4c79a5f), word for word: the model's logits of
    the completion [b, T, V], then logit - logsumexp one row at a time in fp32."""
    T = num_completion_tokens
    logprobs, entropies = [], []
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    for start in range(0, ids.shape[0], micro_batch):
        rows = slice(start, start + micro_batch)
        with grpo.autocast(model.device.type, compute_dtype):
            logits = model(input_ids=ids[rows], attention_mask=attention_mask[rows],
                           position_ids=position_ids[rows], logits_to_keep=T + 1).logits[:, :-1]
        for row_logits, targets in zip(logits, ids[rows, -T:]):
            scaled = row_logits.float() / temperature
            log_norm = torch.logsumexp(scaled, dim=-1)
            logprobs.append(scaled.gather(-1, targets[:, None]).squeeze(-1) - log_norm)
            if with_entropy:
                with torch.no_grad():
                    entropies.append(log_norm - (torch.softmax(scaled, -1) * scaled).sum(-1))
    return torch.stack(logprobs), torch.stack(entropies) if with_entropy else None


def tiny(kind, vocab=103, seed=0):
    """A random tiny causal LM of another architecture, built from its config (offline)."""
    import transformers as tf
    torch.manual_seed(seed)
    shared = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    config = {"llama": lambda: tf.LlamaConfig(**shared, tie_word_embeddings=False),
              "gpt2": lambda: tf.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=2,
                                            n_positions=256, bos_token_id=1, eos_token_id=2),
              # a sliding window (4) shorter than the rows: Gemma 3's mix of local and global layers
              "gemma3": lambda: tf.Gemma3TextConfig(
                  **shared, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
              # a convolution layer in its cache (not plain keys and values)
              "lfm2": lambda: tf.Lfm2Config(
                  vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1,
                  layer_types=["conv", "full_attention"]),
              }[kind]()
    return tf.AutoModelForCausalLM.from_config(config).float().eval()  # GPT-2 has dropout


def rows(vocab=103, lengths=((5, 7), (2, 5), (3, 1)), seed=0):
    """(ids, attention, mask) of prompts + completions of the given lengths, random ids >= 3."""
    generator = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(3, vocab, (n,), generator=generator).tolist()  # noqa: E731
    prompts, completions = zip(*[(draw(p), draw(c)) for p, c in lengths])
    return grpo.build_batch(list(prompts), list(completions), pad_id=0)


def run(fn, model, batch, dtype, micro_batch):
    """log-probs, entropies [B, T] and each weight's gradient of a weighted sum of the log-probs."""
    ids, attention, mask = batch
    model.zero_grad(set_to_none=True)
    logp, entropy = fn(model, ids, attention, mask.shape[1], 0.7, micro_batch, True, dtype)
    weights = torch.linspace(-1, 1, logp.numel()).view_as(logp) * mask  # some up, some down
    (logp * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logp.detach() * mask, entropy * mask, grads


def relative(got, want):
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def compare(model, batch, dtype, micro_batch, skip=()):
    """The largest differences (log-prob, entropy, relative gradient) between the chunks and the
    reference, gradients of the weights named in skip left out."""
    logp, entropy, grads = run(grpo.token_logprobs, model, batch, dtype, micro_batch)
    ref_logp, ref_entropy, ref_grads = run(reference_token_logprobs, model, batch, dtype,
                                           micro_batch)
    assert grads.keys() == ref_grads.keys()
    return ((logp - ref_logp).abs().max().item(), (entropy - ref_entropy).abs().max().item(),
            max(relative(grads[n], ref_grads[n]) for n in grads if n not in skip))


@pytest.mark.parametrize("chunk", [512, 4, 1])  # one chunk; a chunk across rows; a token a chunk
@pytest.mark.parametrize("micro_batch", [3, 2])
def test_chunks_equal_the_reference_in_fp32(tiny_model_dir, monkeypatch, chunk, micro_batch):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    monkeypatch.setattr(grpo, "LOGIT_CHUNK", chunk)
    logp, entropy, grad = compare(model, rows(), torch.float32, micro_batch)
    assert logp <= FP32_LOGP and entropy <= FP32_LOGP and grad <= FP32_GRAD


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma3", "lfm2"])
def test_chunks_equal_the_reference_on_other_architectures(monkeypatch, kind):
    """An untied head (llama), absolute positions and a base model named `transformer` (GPT-2), a
    sliding window and scaled embeddings (Gemma 3), a convolution layer (LFM2)."""
    monkeypatch.setattr(grpo, "LOGIT_CHUNK", 5)
    logp, entropy, grad = compare(tiny(kind), rows(), torch.float32, 2)
    assert logp <= FP32_LOGP and entropy <= FP32_LOGP and grad <= FP32_GRAD


def test_chunks_equal_the_reference_under_bf16_autocast(tiny_model_dir):
    """One micro-batch in one chunk (train_step's call at completions up to LOGIT_CHUNK tokens in
    all): the same bf16 operations, the same numbers."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    logp, entropy, grad = compare(model, rows(), torch.bfloat16, 3)
    assert logp <= FP32_LOGP and entropy <= FP32_LOGP and grad <= FP32_GRAD


def test_chunks_under_bf16_differ_only_in_the_rounding_of_the_heads_gradient(tiny_model_dir,
                                                                             monkeypatch):
    """In chunks under bf16 autocast the log-probs and every gradient but the output layer's
    weight are the reference's; that weight's gradient, a sum over tokens, is rounded to bf16 once
    per chunk and added in fp32 (the reference rounds the whole sum once): as close to the fp32
    gradient as the reference's, and within bf16 rounding of it."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    monkeypatch.setattr(grpo, "LOGIT_CHUNK", 4)
    head = "model.embed_tokens.weight"  # tied: the output layer's weight
    batch = rows()
    logp, entropy, grad = compare(model, batch, torch.bfloat16, 3, skip=(head,))
    assert logp <= FP32_LOGP and entropy <= FP32_LOGP and grad <= FP32_GRAD
    chunked = run(grpo.token_logprobs, model, batch, torch.bfloat16, 3)[2][head]
    reference = run(reference_token_logprobs, model, batch, torch.bfloat16, 3)[2][head]
    exact = run(reference_token_logprobs, model, batch, torch.float32, 3)[2][head]
    assert relative(chunked, reference) < 2 ** -7  # bf16 keeps 8 bits of mantissa
    assert relative(chunked, exact) <= 1.1 * relative(reference, exact)


def test_entropy_has_no_gradient_and_matches_its_definition(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    monkeypatch.setattr(grpo, "LOGIT_CHUNK", 4)
    ids, attention, mask = rows()
    logp, entropy = grpo.token_logprobs(model, ids, attention, mask.shape[1], 0.7, 3, True)
    assert logp.requires_grad and not entropy.requires_grad
    logits = model(input_ids=ids, attention_mask=attention).logits[:, -mask.shape[1] - 1:-1] / 0.7
    p = torch.softmax(logits.float(), -1)  # [B, T, V]
    want = -(p * torch.log(p)).sum(-1)  # H = -sum_v p_v log p_v
    torch.testing.assert_close(entropy[mask.bool()], want[mask.bool()].detach(), atol=1e-5, rtol=0)
    assert grpo.token_logprobs(model, ids, attention, mask.shape[1], 0.7, 3)[1] is None


def saved_bytes_per_token(fn, model, vocab, dtype):
    """Bytes the autograd graph keeps for the backward pass per completion token, from two lengths
    (what grows with T), counted by saved-tensor hooks (each storage once)."""
    kept = []
    for T in (32, 96):
        ids, attention, mask = rows(vocab, ((8, T), (8, T)))
        storages = {}

        def pack(tensor):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor.detach()  # the tensor itself: a reference cycle, never freed
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logp, _ = fn(model, ids, attention, mask.shape[1], 1.0, 2, False, dtype)
        kept.append(sum(storages.values()))
        logp.sum().backward()  # the graph runs: what was kept was enough
    return (kept[1] - kept[0]) / (2 * 64)  # 2 rows x 64 more tokens


def body_only(model, ids, attention_mask, num_completion_tokens, temperature, micro_batch,
              with_entropy=False, compute_dtype=torch.float32):
    """The model's body alone, as token_logprobs runs it (no head): what any log-prob step keeps."""
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    with grpo.autocast(model.device.type, compute_dtype):
        states = model.base_model(input_ids=ids, attention_mask=attention_mask,
                                  position_ids=position_ids).last_hidden_state
    return states[:, -num_completion_tokens - 1:-1].sum(-1), None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backward_keeps_no_logits(dtype):
    """At a vocabulary of 16,384 (width d = 64) the reference keeps the fp32 logits for its
    log-sum-exp, 4 V bytes a token, beyond what the body keeps; the chunks keep the hidden states
    (4 d bytes a token) and the target ids (8), no V-sized tensor."""
    vocab, width = 16384, 64
    model = tiny("llama", vocab)
    body = saved_bytes_per_token(body_only, model, vocab, dtype)
    reference = saved_bytes_per_token(reference_token_logprobs, model, vocab, dtype)
    chunked = saved_bytes_per_token(grpo.token_logprobs, model, vocab, dtype)
    assert reference - body >= 4 * vocab
    assert chunked - body <= 4 * width + 8


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "granite"])
def test_the_output_layer_adds_what_the_family_adds_after_it(kind):
    """Gemma 2 soft-caps its logits, Cohere and Granite scale them: the chunks reproduce each, so
    the log-probs are the model's own, and the start-up check passes."""
    import transformers as tf
    torch.manual_seed(0)
    shared = dict(vocab_size=103, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    config = {"gemma2": lambda: tf.Gemma2Config(**shared, final_logit_softcapping=0.5),
              "cohere": lambda: tf.CohereConfig(**shared, logit_scale=0.25),
              "granite": lambda: tf.GraniteConfig(**shared, logits_scaling=4.0)}[kind]()
    model = tf.AutoModelForCausalLM.from_config(config).float().eval()
    grpo.check_output_logits(model)
    logp_gap, entropy_gap, grad_gap = compare(model, rows(), torch.float32, micro_batch=3)
    assert logp_gap < FP32_LOGP and entropy_gap < FP32_LOGP and grad_gap < FP32_GRAD


def test_a_logit_change_it_does_not_know_is_refused_at_start():
    """A model whose config claims a scale its forward never applies stands in for a family that
    changes its logits some other way: one line, before any training."""
    model = tiny("llama")
    model.config.logit_scale = 0.5  # LlamaForCausalLM ignores it; output_logits would apply it
    with pytest.raises(SystemExit) as err:
        grpo.check_output_logits(model)
    assert str(err.value).startswith("error: LlamaForCausalLM changes its logits")
