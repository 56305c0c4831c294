"""Is a modular-addition teacher's number layout Fourier-sparse (the grokking signature)?

    python docs/results/evidence_modular/fourier_audit.py outputs/demo_modular/teachers/teacher_qwen2 17
    python docs/results/evidence_modular/fourier_audit.py outputs/demo_modular/teachers/teacher_other 17 3


Layer 0's values and (pre-RoPE) keys of a number token depend on its embedding alone, so the layout of
the numbers 0..p-1 is read from the embeddings: for each code (embedding, layer-0 V, layer-0 K), the
share of its power over the numbers in its top-2 Fourier frequencies (uniform: 2 / (p // 2)), and the
R² of its centred Gram by a function of (a - b) mod p (a random code is near-diagonal, hence also
near-circulant: the Fourier share is the telling number). The same for an untrained copy (seed 0).
With a primitive root g as third argument (3 for p = 17) the cycle is multiplication's instead: the
nonzero numbers in the order g^0, g^1, ..., g^(p-2), where a*b mod p is addition of exponents mod p-1.
"""

import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvdistill.models import load_tokenizer


def audit(model, ids: torch.Tensor, name: str) -> None:
    """`ids [p]`: the numbers' tokens in cycle order (the cycle's length p)."""
    p = len(ids)
    layer = model.model.layers[0]
    with torch.no_grad():
        emb = model.model.embed_tokens(ids)  # [p, d]
        x = layer.input_layernorm(emb)
        codes = {"embed": emb, "v0": layer.self_attn.v_proj(x), "k0": layer.self_attn.k_proj(x)}
    diff = (torch.arange(p)[:, None] - torch.arange(p)[None, :]) % p  # [p, p]
    for kind, f in codes.items():
        f = f - f.mean(0)
        gram = f @ f.T  # [p, p]
        circulant = torch.stack([gram[diff == k].mean() for k in range(p)])[diff]
        r2 = 1 - ((gram - circulant) ** 2).sum() / ((gram - gram.mean()) ** 2).sum()
        power = torch.fft.rfft(f, dim=0).abs().pow(2).sum(1)[1:]  # [p // 2] frequencies 1..p // 2
        top = power.sort(descending=True)
        print(f"{name:10s} {kind:6s} circulant R2 {r2:.3f}  top-2 frequency share "
              f"{top.values[:2].sum() / power.sum():.3f} (frequencies {(top.indices[:2] + 1).tolist()}; "
              f"uniform {2 / len(power):.3f})")


def main(path: str, p: int, g: int | None = None) -> None:
    tok = load_tokenizer(path)
    cycle = range(p) if g is None else [pow(g, k, p) for k in range(p - 1)]
    assert g is None or len(set(cycle)) == p - 1, f"{g} is not a primitive root mod {p}"
    ids = torch.tensor([tok.convert_tokens_to_ids(str(v)) for v in cycle])
    audit(AutoModelForCausalLM.from_pretrained(path), ids, "trained")
    torch.manual_seed(0)
    audit(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)), ids, "untrained")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
