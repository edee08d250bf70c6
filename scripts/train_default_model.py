"""Train mindspec's default model: a small DeepSeek-V3-architecture model with 3 MTP modules,
on the Python standard library's own source, on a CPU, deterministically.

    python scripts/train_default_model.py --out mindspec/assets/default_model

Corpus: every stdlib .py file found through sysconfig (tests, idlelib and site-packages excluded);
every 40th file, in sorted order, is held out for evaluation. Tokenizer: byte-level BPE (4096).
Model: MLA with q_lora, DeepSeekMoE (sigmoid noaux_tc group routing, one shared expert, a dense
first layer), DeepSeek-V3's YaRN rope settings, many thin layers (drafting K tokens costs K runs of
one MTP layer; verifying costs all main layers, so thin-and-deep makes speculation pay), and 3 MTP
modules trained jointly with DeepSeek's MTP objective (module k predicts t(i+k+1) from module
k-1's hidden state and the embedding of t(i+k)). Routing balance uses DeepSeek's auxiliary-loss-free
bias update. Then a second phase fine-tunes only the MTP modules towards the main model's own
predictions (self-distillation, see ``distill``); ``--distill-from CKPT`` runs that phase alone on an
existing checkpoint. Saved in DeepSeek's Hugging Face layout, bf16 safetensors, with the tokenizer.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from mindspec.bench.corpus import corpus_files, read  # the one corpus definition, shared with the benchmarks
from mindspec.modeling.rotary import build_rotary, rope_parameters, softmax_scale

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
# A code model has no roles: a chat is the messages' text joined by newlines after BOS, and the
# model continues it as code. List contents keep their text parts (OpenAI's content-part form).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{% if not loop.last %}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
)

CONFIG = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=4096, hidden_size=192,
    intermediate_size=512, moe_intermediate_size=96, num_hidden_layers=12, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
    v_head_dim=32, n_routed_experts=6, n_shared_experts=1, num_experts_per_tok=2, n_group=3, topk_group=2,
    topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
    first_k_dense_replace=1, rms_norm_eps=1e-6, max_position_embeddings=163840, tie_word_embeddings=False,
    num_nextn_predict_layers=3, rope_interleave=True, hidden_act="silu", initializer_range=0.02,
    attention_bias=False, bos_token_id=0, eos_token_id=1,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=1.0, mscale_all_dim=1.0),
    rope_theta=10000,
)


# ---- corpus and tokenizer ------------------------------------------------------------------------


def train_tokenizer(files: list[Path], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((read(f) for f in files), trainer=trainer)
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, clean_up_tokenization_spaces=False,
                                   chat_template=CHAT_TEMPLATE)


def encode_files(tokenizer, files: list[Path]) -> np.ndarray:
    ids = []
    for f in files:
        ids.extend(tokenizer.encode(read(f)))  # bos + text
        ids.append(tokenizer.eos_token_id)
    return np.asarray(ids, dtype=np.int32)


# ---- model ------------------------------------------------------------------------------------------


def rms_norm(x, w, eps=1e-6):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Rope(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        rope = rope_parameters(cfg)
        rot = build_rotary(cfg["qk_rope_head_dim"], rope, cfg["max_position_embeddings"])
        self.register_buffer("inv_freq", rot.inv_freq, persistent=False)
        self.factor = rot.attention_factor
        self.scale = softmax_scale(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], rope)

    def forward(self, x):  # x [B, L, H, P], interleaved pairs, positions 0..L-1
        angles = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * self.inv_freq  # [L, P/2]
        cos, sin = (angles.cos() * self.factor).to(x.dtype), (angles.sin() * self.factor).to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        cos, sin = cos[None, :, None], sin[None, :, None]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


def _linear(out_f, in_f, std=0.02):
    return nn.Parameter(torch.randn(out_f, in_f) * std)


class Mla(nn.Module):
    def __init__(self, cfg, rope: Rope):
        super().__init__()
        h, n = cfg["hidden_size"], cfg["num_attention_heads"]
        self.n, self.nope, self.rp, self.v, self.r = n, cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
        self.rope = rope
        self.q_a_proj = _linear(cfg["q_lora_rank"], h)
        self.q_a_layernorm = nn.Parameter(torch.ones(cfg["q_lora_rank"]))
        self.q_b_proj = _linear(n * (self.nope + self.rp), cfg["q_lora_rank"])
        self.kv_a_proj_with_mqa = _linear(self.r + self.rp, h)
        self.kv_a_layernorm = nn.Parameter(torch.ones(self.r))
        self.kv_b_proj = _linear(n * (self.nope + self.v), self.r)
        self.o_proj = _linear(h, n * self.v)

    def forward(self, x):
        b, l, _ = x.shape
        q = F.linear(rms_norm(F.linear(x, self.q_a_proj), self.q_a_layernorm), self.q_b_proj).view(b, l, self.n, -1)
        q_nope, q_pe = q.split([self.nope, self.rp], -1)
        kv_a = F.linear(x, self.kv_a_proj_with_mqa)
        c = rms_norm(kv_a[..., : self.r], self.kv_a_layernorm)
        k_pe = self.rope(kv_a[..., None, self.r :]).expand(b, l, self.n, self.rp)
        k_nope, v = F.linear(c, self.kv_b_proj).view(b, l, self.n, -1).split([self.nope, self.v], -1)
        q = torch.cat([q_nope, self.rope(q_pe)], -1).transpose(1, 2)
        k = torch.cat([k_nope, k_pe], -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, scale=self.rope.scale)
        return F.linear(o.transpose(1, 2).reshape(b, l, -1), self.o_proj)


class Mlp(nn.Module):
    def __init__(self, h, inter):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(inter, h), _linear(inter, h), _linear(h, inter)

    def forward(self, x):
        return F.linear(F.silu(F.linear(x, self.gate_proj)) * F.linear(x, self.up_proj), self.down_proj)


class Moe(nn.Module):
    """Sigmoid noaux_tc routing as DeepSeek-V3; experts computed densely and masked (fast for a
    handful of small experts on a CPU)."""

    def __init__(self, cfg):
        super().__init__()
        h, i, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
        self.cfg = cfg
        self.gate = _linear(e, h)
        self.register_buffer("e_score_correction_bias", torch.zeros(e))
        self.w_gate = nn.Parameter(torch.randn(e, i, h) * 0.02)
        self.w_up = nn.Parameter(torch.randn(e, i, h) * 0.02)
        self.w_down = nn.Parameter(torch.randn(e, h, i) * 0.02)
        self.shared = Mlp(h, i * cfg["n_shared_experts"])
        self.load = torch.zeros(e)

    def route(self, x):
        c = self.cfg
        s = torch.sigmoid(F.linear(x.float(), self.gate.float()))  # [T, E]
        choice = s + self.e_score_correction_bias
        t, e = s.shape
        groups = choice.view(t, c["n_group"], -1).topk(2, -1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(c["topk_group"], -1).indices, 1.0)
        mask = keep.repeat_interleave(e // c["n_group"], 1).bool()
        ids = choice.masked_fill(~mask, float("-inf")).topk(c["num_experts_per_tok"], -1).indices
        w = s.gather(1, ids)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * c["routed_scaling_factor"]
        return torch.zeros_like(s).scatter(1, ids, w), ids

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        combine, ids = self.route(x)
        if self.training:
            self.load += torch.bincount(ids.flatten(), minlength=combine.shape[1]).float()
        g = torch.einsum("th,eih->eti", x, self.w_gate)
        u = torch.einsum("th,eih->eti", x, self.w_up)
        y = torch.einsum("eti,ehi->eth", F.silu(g) * u, self.w_down)
        out = torch.einsum("te,eth->th", combine.to(y.dtype), y) + self.shared(x)
        return out.view(shape)

    @torch.no_grad()
    def balance(self, rate: float):
        """DeepSeek-V3's auxiliary-loss-free balancing: nudge under-loaded experts up."""
        if self.load.sum() > 0:
            self.e_score_correction_bias += rate * torch.sign(self.load.mean() - self.load)
        self.load.zero_()


class Block(nn.Module):
    def __init__(self, cfg, rope, moe: bool):
        super().__init__()
        h = cfg["hidden_size"]
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.self_attn = Mla(cfg, rope)
        self.mlp = Moe(cfg) if moe else Mlp(h, cfg["intermediate_size"])

    def forward(self, x):
        x = x + self.self_attn(rms_norm(x, self.input_layernorm))
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm))


class MtpModule(nn.Module):
    def __init__(self, cfg, rope):
        super().__init__()
        h = cfg["hidden_size"]
        self.enorm, self.hnorm, self.head_norm = (nn.Parameter(torch.ones(h)) for _ in range(3))
        self.eh_proj = _linear(h, 2 * h)
        self.block = Block(cfg, rope, moe=True)

    def forward(self, emb, hidden):  # -> block output before the shared-head norm
        return self.block(F.linear(torch.cat([rms_norm(emb, self.enorm), rms_norm(hidden, self.hnorm)], -1), self.eh_proj))


class DeepseekV3Small(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, v = cfg["hidden_size"], cfg["vocab_size"]
        self.cfg = cfg
        self.rope = Rope(cfg)
        self.embed = nn.Parameter(torch.randn(v, h) * 0.02)
        self.layers = nn.ModuleList(Block(cfg, self.rope, i >= cfg["first_k_dense_replace"]) for i in range(cfg["num_hidden_layers"]))
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = _linear(v, h)
        self.mtp = nn.ModuleList(MtpModule(cfg, self.rope) for _ in range(cfg["num_nextn_predict_layers"]))

    def forward(self, ids):
        """ids [B, L + D] -> (main logits [B, L, V], [MTP depth k logits [B, L, V]])."""
        hidden, logits = self.forward_main(ids[:, : ids.shape[1] - len(self.mtp)])
        return logits, self.forward_mtp(ids, hidden)

    def forward_main(self, ids):
        """ids [B, L] -> (final-norm hidden [B, L, h], logits [B, L, V])."""
        x = F.embedding(ids, self.embed)
        for layer in self.layers:
            x = layer(x)
        hidden = rms_norm(x, self.norm)
        return hidden, F.linear(hidden, self.lm_head)

    def forward_mtp(self, ids, hidden):
        """ids [B, L + D], main hidden [B, L, h] -> [MTP depth k logits [B, L, V]]: depth k at i
        predicts t(i+k+1) from depth k-1's state and the embedding of t(i+k)."""
        length = hidden.shape[1]
        mtp_logits, h = [], hidden
        for k, module in enumerate(self.mtp, start=1):
            h = module(F.embedding(ids[:, k : k + length], self.embed), h)
            mtp_logits.append(F.linear(rms_norm(h, module.head_norm), self.lm_head))
        return mtp_logits

    def moe_layers(self):
        return [m for m in self.modules() if isinstance(m, Moe)]


# ---- saving in DeepSeek's Hugging Face layout ---------------------------------------------------


def hf_state_dict(model: DeepseekV3Small) -> dict[str, torch.Tensor]:
    cfg = model.cfg
    out = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm, "lm_head.weight": model.lm_head}

    def block(prefix, b: Block):
        out[prefix + "input_layernorm.weight"] = b.input_layernorm
        out[prefix + "post_attention_layernorm.weight"] = b.post_attention_layernorm
        for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            out[f"{prefix}self_attn.{name}.weight"] = getattr(b.self_attn, name)
        out[prefix + "self_attn.q_a_layernorm.weight"] = b.self_attn.q_a_layernorm
        out[prefix + "self_attn.kv_a_layernorm.weight"] = b.self_attn.kv_a_layernorm
        mlp = b.mlp
        if isinstance(mlp, Moe):
            out[prefix + "mlp.gate.weight"] = mlp.gate
            out[prefix + "mlp.gate.e_score_correction_bias"] = mlp.e_score_correction_bias
            for e in range(cfg["n_routed_experts"]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = mlp.w_gate[e]
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = mlp.w_up[e]
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = mlp.w_down[e]
            mlp = mlp.shared
            prefix = prefix + "mlp.shared_experts."
        else:
            prefix = prefix + "mlp."
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"{prefix}{name}.weight"] = getattr(mlp, name)

    for i, layer in enumerate(model.layers):
        block(f"model.layers.{i}.", layer)
    for j, module in enumerate(model.mtp):
        p = f"model.layers.{cfg['num_hidden_layers'] + j}."
        block(p, module.block)
        out[p + "enorm.weight"], out[p + "hnorm.weight"] = module.enorm, module.hnorm
        out[p + "eh_proj.weight"] = module.eh_proj
        out[p + "shared_head.norm.weight"] = module.head_norm
    return {k: v.detach().contiguous() for k, v in out.items()}


def load(path: Path) -> tuple[DeepseekV3Small, object]:
    """A checkpoint written by ``save`` back into the training model (and its tokenizer)."""
    from safetensors.torch import load_file
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    model = DeepseekV3Small(cfg)
    saved = load_file(str(path / "model.safetensors"))
    # hf_state_dict's tensors are views of the parameters (per-expert rows of the stacked expert
    # weights included), so copying into them fills the model.
    targets = hf_state_dict(model)
    if set(targets) != set(saved):
        raise ValueError(f"{path}: tensors differ from the training model's: {sorted(set(targets) ^ set(saved))[:5]}")
    with torch.no_grad():
        for name, t in targets.items():
            t.copy_(saved[name])
    return model, PreTrainedTokenizerFast.from_pretrained(str(path))


def save(model, tokenizer, out: Path, dtype=torch.bfloat16) -> None:
    """tokenizer: a tokenizer to save, or a checkpoint directory whose tokenizer files are copied."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: (v.float() if k.endswith("e_score_correction_bias") else v.to(dtype)).contiguous().clone()
        for k, v in hf_state_dict(model).items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**model.cfg, "torch_dtype": str(dtype).split(".")[-1]}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}, indent=2) + "\n")
    if isinstance(tokenizer, Path):  # the tokenizer files of an earlier checkpoint, unchanged
        for f in tokenizer.glob("*.json"):
            if f.name.startswith(("tokenizer", "special_tokens")) and f.resolve() != (out / f.name).resolve():
                shutil.copyfile(f, out / f.name)
    else:
        tokenizer.save_pretrained(str(out))


# ---- training -------------------------------------------------------------------------------------


def batches(data: np.ndarray, batch: int, length: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(data) - length - 1, batch)
        yield torch.from_numpy(np.stack([data[s : s + length] for s in starts]).astype(np.int64))


def losses(model, ids, mtp_weight: float):
    d = len(model.mtp)
    length = ids.shape[1] - d - 1
    logits, mtp_logits = model(ids[:, : length + d])
    v = logits.shape[-1]
    main = F.cross_entropy(logits.reshape(-1, v).float(), ids[:, 1 : length + 1].reshape(-1))
    mtp = [F.cross_entropy(m.reshape(-1, v).float(), ids[:, k + 1 : k + 1 + length].reshape(-1))
           for k, m in enumerate(mtp_logits, start=1)]
    return main, mtp, main + mtp_weight * sum(mtp) / max(1, d)


@torch.no_grad()
def agreement(model, ids: torch.Tensor) -> list[float]:
    """ids [B, L + D] -> per MTP depth k, how often its top-1 equals the main model's top-1 for the
    same token (depth k at i predicts t(i+k+1), main at i+k), inputs teacher-forced."""
    d = len(model.mtp)
    length = ids.shape[1] - d
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden, logits = model.forward_main(ids)
        mtp_logits = model.forward_mtp(ids, hidden[:, :length])
    greedy = logits.argmax(-1)  # [B, L + D]: main's prediction of t(i+1) at i
    return [float((m.argmax(-1) == greedy[:, k : k + length]).float().mean()) for k, m in enumerate(mtp_logits, start=1)]


@torch.no_grad()
def evaluate(model, data: np.ndarray, length: int, windows: int = 64) -> dict:
    model.eval()
    rng = np.random.default_rng(1234)
    ids = next(batches(data, windows, length + len(model.mtp) + 1, rng))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        main, mtp, _ = losses(model, ids, 0.0)
    agree = agreement(model, ids[:, : length + len(model.mtp)])
    model.train()
    return {"heldout_loss": float(main), "heldout_mtp_loss": [float(x) for x in mtp], "mtp_top1_agreement": agree}


# ---- MTP self-distillation ------------------------------------------------------------------------
# In greedy speculative decoding a draft is accepted when it equals the main model's top-1, and the
# tokens a module sees are the main model's own outputs. So the second phase fine-tunes only the MTP
# modules (main model frozen) towards the main model's distribution for the token they draft, on a
# mix of training text and the main model's greedy continuations of training-text prompts (the
# self-distillation of Medusa-2 / EAGLE's draft training). Held-out files stay unseen.


def prompts_from(data: np.ndarray, count: int, prompt_tokens: int, bos: int, rng: np.random.Generator) -> list[list[int]]:
    """``count`` windows of ``prompt_tokens`` tokens, BOS first, as the benchmarks' prompts."""
    starts = rng.integers(0, len(data) - prompt_tokens, count)
    return [[bos] + data[s : s + prompt_tokens - 1].tolist() for s in starts]


def greedy_continuations(checkpoint: Path, prompt_sets: list[list[list[int]]], new_tokens: int) -> list[torch.Tensor]:
    """Per set, each prompt followed by the checkpoint's greedy continuation, by mindspec (one
    engine for every set) -> [N, P + new] int64 each."""
    from mindspec import LLM, SamplingParams

    llm = LLM(model=str(checkpoint), dtype="float32", cache_block_size=16, num_blocks=4096, progress=False,
              max_batch_size=32)
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [torch.tensor([p + o.token_ids for p, o in zip(prompts, llm.generate(prompts, greedy))], dtype=torch.int64)
            for prompts in prompt_sets]


def distill_losses(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """ids [B, L + D] -> per MTP depth, the cross-entropy of its prediction against the main model's
    distribution for the same token (soft targets; the main model runs without gradients)."""
    d = len(model.mtp)
    length = ids.shape[1] - d
    with torch.no_grad():
        hidden, teacher = model.forward_main(ids)  # [B, L + D, h], [B, L + D, V]
    out = []
    for k, m in enumerate(model.forward_mtp(ids, hidden[:, :length]), start=1):
        target = teacher[:, k : k + length].float().softmax(-1)
        out.append(-(target * m.float().log_softmax(-1)).sum(-1).mean())
    return out


def distill(args, checkpoint: Path, out: Path) -> dict:
    """Fine-tune the MTP modules of ``checkpoint`` (see above) and save the result to ``out``."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model, tokenizer = load(checkpoint)
    train_files, held_files = _files(args)
    train_data, held_data = encode_files(tokenizer, train_files), encode_files(tokenizer, held_files)
    d = len(model.mtp)
    window = args.seq_len + d
    if not 1 <= args.distill_prompt_tokens < window:
        raise ValueError(f"--distill-prompt-tokens must be in [1, {window}) (seq_len + MTP depth)")
    rng = np.random.default_rng(args.seed + 1)
    start = time.time()
    bos, new = tokenizer.bos_token_id, window - args.distill_prompt_tokens
    generated, held = greedy_continuations(checkpoint, [
        prompts_from(train_data, args.distill_sequences, args.distill_prompt_tokens, bos, rng),
        prompts_from(held_data, 32, args.distill_prompt_tokens, bos, np.random.default_rng(1234)),
    ], new)
    print(f"distill: {len(generated)} greedy continuations of {new} tokens in {time.time() - start:.0f}s", flush=True)
    before = {"heldout": evaluate(model, held_data, args.seq_len)["mtp_top1_agreement"],
              "heldout_greedy": agreement(model, held)}
    for p in model.parameters():
        p.requires_grad_(False)
    params = list(model.mtp.parameters())
    for p in params:
        p.requires_grad_(True)
    model.layers.eval()  # frozen: their routers keep no load statistics
    mtp_moes = [m for m in model.mtp.modules() if isinstance(m, Moe)]
    opt = torch.optim.AdamW(params, lr=args.distill_lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.distill_steps))))
    n_real = round(args.batch * args.distill_real_share)
    real = batches(train_data, n_real, window, rng) if n_real else None
    for step in range(args.distill_steps):
        own = generated[torch.from_numpy(rng.integers(0, len(generated), args.batch - n_real))]
        ids = own if real is None else torch.cat([next(real), own])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            per_depth = distill_losses(model, ids)
        opt.zero_grad(set_to_none=True)
        sum(per_depth).div(d).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        for moe in mtp_moes:
            moe.balance(args.balance_rate)
        if step % args.log_every == 0 or step == args.distill_steps - 1:
            print(f"distill step {step} soft ce {[round(x.item(), 3) for x in per_depth]} {time.time() - start:.0f}s", flush=True)
    metrics = evaluate(model, held_data, args.seq_len)
    metrics["mtp_top1_agreement_greedy"] = agreement(model, held)
    metrics["distill"] = dict(steps=args.distill_steps, sequences=len(generated), seconds=round(time.time() - start),
                              agreement_before=before)
    print(json.dumps(metrics, indent=2))
    save(model, checkpoint, out)
    return metrics


def _files(args) -> tuple[list[Path], list[Path]]:
    train_files, held_files = corpus_files()
    if args.max_files:
        train_files, held_files = train_files[: args.max_files], held_files[: max(1, args.max_files // 10)]
    return train_files, held_files


def train(args) -> dict:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    train_files, held_files = _files(args)
    tokenizer = train_tokenizer(train_files, CONFIG["vocab_size"])
    train_data, held_data = encode_files(tokenizer, train_files), encode_files(tokenizer, held_files)
    print(f"corpus: {len(train_files)} train files ({len(train_data)} tokens), {len(held_files)} held out ({len(held_data)} tokens)")
    cfg = dict(CONFIG)
    model = DeepseekV3Small(cfg)
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    data = batches(train_data, args.batch, args.seq_len + len(model.mtp) + 1, np.random.default_rng(args.seed))
    start = time.time()
    for step in range(args.steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            main, mtp, loss = losses(model, next(data), args.mtp_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        for moe in model.moe_layers():
            moe.balance(args.balance_rate)
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"step {step} loss {main.item():.3f} mtp {[round(m.item(), 3) for m in mtp]} "
                  f"{time.time() - start:.0f}s", flush=True)
    metrics = evaluate(model, held_data, args.seq_len)
    metrics.update(steps=args.steps, seconds=round(time.time() - start), seed=args.seed,
                   train_tokens=int(len(train_data)), parameters=sum(p.numel() for p in model.parameters()))
    print(json.dumps(metrics, indent=2))
    save(model, tokenizer, Path(args.out))
    (Path(args.out) / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=2200)  # the shipped model
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--mtp-weight", type=float, default=0.3)  # DeepSeek-V3's lambda early in training
    p.add_argument("--balance-rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--max-files", type=int, default=0, help="use only the first N files (smoke tests)")
    p.add_argument("--distill-from", help="skip pre-training: self-distil the MTP modules of this checkpoint into --out")
    p.add_argument("--distill-steps", type=int, default=1500, help="MTP self-distillation steps after pre-training (0: none)")
    p.add_argument("--distill-lr", type=float, default=2e-3)
    p.add_argument("--distill-sequences", type=int, default=2048, help="greedy continuations to train on")
    p.add_argument("--distill-prompt-tokens", type=int, default=64)
    p.add_argument("--distill-real-share", type=float, default=0.25, help="share of each batch cut from training text")
    return p.parse_args(argv)


def main(args) -> dict:
    """Pre-training (unless --distill-from), then the MTP self-distillation; the checkpoint and
    training_metrics.json land in --out."""
    out = Path(args.out)
    if args.distill_from:
        source = Path(args.distill_from)
        recorded = source / "training_metrics.json"  # pre-training's record, kept where it exists
        metrics = json.loads(recorded.read_text()) if recorded.exists() else {}
    else:
        source, metrics = out, train(args)
    if args.distill_steps:
        metrics["mtp_distillation"] = distill(args, source, out)
        (out / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


if __name__ == "__main__":
    main(parse_args())
