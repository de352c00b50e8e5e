#!/usr/bin/python3
"""Writes tests/data/llama_reference/: a tiny Llama model and its outputs,
computed independently of the C++ code (plain torch, float64, no transformers),
for pipeline/llama_test.cc.

Run with Debian's python (apt python3-torch); CI only reads the committed files:

    /usr/bin/python3 scripts/gen_llama_reference.py

Files (safetensors: u64 LE header length, JSON header, raw little-endian F32):
  weights.safetensors   every parameter under its Hugging Face
                        LlamaForCausalLM name; __metadata__ holds the config.
  expected.safetensors  input_ids [B,T] (token ids as F32), hidden_0 (output
                        of embedding + layer 0, [B,T,D]), logits ([B,T,V],
                        untied lm_head), logits_tied (lm_head = embed_tokens).

The math follows Hugging Face's Llama: RMSNorm w * x / sqrt(mean(x^2) + eps),
rotary embeddings in the rotate_half convention, grouped-query attention
(key/value head j serves query heads j*rep .. j*rep+rep-1), causal softmax,
SwiGLU MLP down(silu(gate(x)) * up(x)), final RMSNorm, LM head.
"""
import json
import math
import os
import struct

import torch

CONFIG = dict(vocab_size=64, seq_len=8, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=48,
              rope_theta=500.0, norm_eps=1e-6)
BATCH = 2
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "llama_reference")


def make_weights(gen):
    c = CONFIG
    d, hd = c["d_model"], c["d_model"] // c["n_head"]

    def mat(*shape):  # large enough that every weight visibly moves the outputs
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.2

    def norm():
        return 1.0 + 0.1 * torch.randn(d, generator=gen, dtype=torch.float64)

    w = {"model.embed_tokens.weight": mat(c["vocab_size"], d)}
    for i in range(c["n_layer"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = mat(c["n_head"] * hd, d)
        w[p + "self_attn.k_proj.weight"] = mat(c["n_kv_head"] * hd, d)
        w[p + "self_attn.v_proj.weight"] = mat(c["n_kv_head"] * hd, d)
        w[p + "self_attn.o_proj.weight"] = mat(d, c["n_head"] * hd)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = mat(c["d_ff"], d)
        w[p + "mlp.up_proj.weight"] = mat(c["d_ff"], d)
        w[p + "mlp.down_proj.weight"] = mat(d, c["d_ff"])
    w["model.norm.weight"] = norm()
    w["lm_head.weight"] = mat(c["vocab_size"], d)
    # Round to float32 once, so that the C++ side sees exactly these weights.
    return {k: v.float().double() for k, v in w.items()}


def rms_norm(x, weight):
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + CONFIG["norm_eps"])


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope(x):  # x: [B, H, T, hd]
    hd, t = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / (CONFIG["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    freqs = torch.outer(torch.arange(t, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return x * emb.cos() + rotate_half(x) * emb.sin()


def attention(x, w, p):
    c = CONFIG
    b, t, d = x.shape
    h, kv, hd = c["n_head"], c["n_kv_head"], d // c["n_head"]
    q = (x @ w[p + "q_proj.weight"].T).view(b, t, h, hd).transpose(1, 2)
    k = (x @ w[p + "k_proj.weight"].T).view(b, t, kv, hd).transpose(1, 2)
    v = (x @ w[p + "v_proj.weight"].T).view(b, t, kv, hd).transpose(1, 2)
    q, k = rope(q), rope(k)
    rep = h // kv
    k = torch.stack([k[:, j // rep] for j in range(h)], dim=1)  # query head j uses kv head j // rep
    v = torch.stack([v[:, j // rep] for j in range(h)], dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    att = scores.masked_fill(future, float("-inf")).softmax(-1)
    y = (att @ v).transpose(1, 2).reshape(b, t, h * hd)
    return y @ w[p + "o_proj.weight"].T


def mlp(x, w, p):
    gate = x @ w[p + "gate_proj.weight"].T
    up = x @ w[p + "up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[p + "down_proj.weight"].T


def block(x, w, i):
    p = f"model.layers.{i}."
    x = x + attention(rms_norm(x, w[p + "input_layernorm.weight"]), w, p + "self_attn.")
    return x + mlp(rms_norm(x, w[p + "post_attention_layernorm.weight"]), w, p + "mlp.")


def write_safetensors(path, tensors, metadata=None):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        data = tensors[name].float().contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def main():
    gen = torch.Generator().manual_seed(1234)
    w = make_weights(gen)
    c = CONFIG
    ids = torch.randint(0, c["vocab_size"], (BATCH, c["seq_len"]), generator=gen)
    x = w["model.embed_tokens.weight"][ids]
    hidden = []
    for i in range(c["n_layer"]):
        x = block(x, w, i)
        hidden.append(x)
    normed = rms_norm(x, w["model.norm.weight"])
    expected = {
        "input_ids": ids.double(),
        "hidden_0": hidden[0],
        "logits": normed @ w["lm_head.weight"].T,
        "logits_tied": normed @ w["model.embed_tokens.weight"].T,
    }
    os.makedirs(OUT_DIR, exist_ok=True)
    write_safetensors(os.path.join(OUT_DIR, "weights.safetensors"), w, {k: repr(v) for k, v in c.items()})
    write_safetensors(os.path.join(OUT_DIR, "expected.safetensors"), expected)
    print("wrote", OUT_DIR)


if __name__ == "__main__":
    main()
