"""Training steps in the frameworks users live in, ours against the framework's own attention (not a test).

    python benchmarks/bench_frameworks.py [--out OUT_DIR] [--quick] [--steps 20] [--rounds 3]

Sections (a family of their own, one per framework):

* ``flax`` - a decoder of ``flax.nnx`` modules (``--layers`` blocks of LayerNorm, ``nnx.MultiHeadAttention``
  and a 4x MLP; bfloat16 compute, float32 parameters), padding masks built the Flax way
  (``make_attention_mask`` of the tokens, ``make_causal_mask``, ``combine_masks``: float 0/1
  ``[B, 1, T, T]``), next-token cross-entropy over the real tokens, plain SGD, one ``nnx.jit`` step.
  ``ours``: ``attention_fn=cudnn_attn.jax_bridge.flax_attention_fn()``; ``flax``: Flax's default
  ``nnx.dot_product_attention``.  Both models start from the same parameters and see the same batch.
* ``flax_dropout`` - the same decoder and step with attention dropout (``dropout_rate=0.1``,
  ``broadcast_dropout=False``: one independent mask per batch row and head, which is what cuDNN draws; Flax's
  default attention then draws its mask with ``jax.random.bernoulli``).  The key comes from the model's
  ``nnx.Rngs`` at every step, traced under ``nnx.jit``: ``ours`` passes it to cuDNN as device operands
  (a fresh Philox mask per step, one compiled program).  The two models' masks differ, so their losses differ
  by more than rounding.
* ``torch`` - rows from ``benchmarks/bench_torch.py`` when that file provides
  ``rows(quick: bool) -> list[dict]`` with the keys of :class:`Row` (see :func:`torch_section`).

Method: after two warm-up steps (compilation), ``--steps`` steps run back to back from Python and
``block_until_ready`` waits for the last loss: the step time is that wall time divided by the number of
steps, so it is bound by the device when the host dispatches faster than the GPU computes (each step
is one jitted program).  Median over ``--rounds``.  The ratio is ours / theirs (below 1: ours is faster).
The losses of the last step of both models are reported too (they train on the same data).

Shapes: B=8 T=2048 d_model=1024 16 heads (head dim 64) 4 layers; ``--quick``: B=4 T=1024.

Writes ``bench_frameworks.json`` into OUT_DIR and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@dataclass(frozen=True)
class DecoderShape:
    batch: int = 8
    length: int = 2048
    d_model: int = 1024
    heads: int = 16
    layers: int = 4
    vocab: int = 8192


@dataclass
class Row:
    framework: str
    case: str
    ours_ms: float | None = None
    theirs_ms: float | None = None
    ratio: float | None = None
    notes: dict = field(default_factory=dict)
    error: str | None = None


# -- the flax decoder (also used by tests/gpu/test_flax_gpu.py) -------------------------------------------

def decoder(attention_fn, shape: DecoderShape, seed: int = 0, dropout_rate: float = 0.0):
    """A ``flax.nnx`` decoder of ``shape`` whose attention is ``attention_fn`` (same ``seed``: same parameters),
    with attention dropout at ``dropout_rate`` (``broadcast_dropout=False``; the key from the model's ``Rngs``)."""
    import jax.numpy as jnp
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            d = shape.d_model
            self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(shape.heads, d, dtype=jnp.bfloat16, decode=False,
                                               attention_fn=attention_fn, dropout_rate=dropout_rate,
                                               broadcast_dropout=False,
                                               deterministic=False if dropout_rate else None, rngs=rngs)
            self.up = nnx.Linear(d, 4 * d, dtype=jnp.bfloat16, rngs=rngs)
            self.down = nnx.Linear(4 * d, d, dtype=jnp.bfloat16, rngs=rngs)

        def __call__(self, x, mask):
            x = x + self.attn(self.norm1(x), mask=mask).astype(jnp.float32)
            return x + self.down(nnx.gelu(self.up(self.norm2(x)))).astype(jnp.float32)

    class Decoder(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(seed)
            self.embed = nnx.Embed(shape.vocab, shape.d_model, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(shape.layers)])
            self.head = nnx.Linear(shape.d_model, shape.vocab, dtype=jnp.bfloat16, rngs=rngs)

        def __call__(self, tokens, mask):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x, mask)
            return self.head(x)

    return Decoder()


def batch(shape: DecoderShape, seed: int = 0):
    """``(tokens (B, T + 1), mask (B, 1, T, T))``: random tokens, row ``b`` padded (token 0) after a random
    length in ``[T/2, T]`` (row 0 full), the Flax-built float padding-and-causal mask of the inputs."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, shape.vocab, size=(shape.batch, shape.length + 1))
    lengths = rng.integers(shape.length // 2, shape.length + 1, size=shape.batch)
    lengths[0] = shape.length + 1
    for b, n in enumerate(lengths):
        tokens[b, n:] = 0
    tokens = jnp.asarray(tokens, jnp.int32)
    inputs = tokens[:, :-1]
    mask = nnx.combine_masks(nnx.make_attention_mask(inputs > 0, inputs > 0), nnx.make_causal_mask(inputs))
    return tokens, mask


def loss(model, tokens, mask):
    import jax
    import jax.numpy as jnp

    logits = model(tokens[:, :-1], mask).astype(jnp.float32)
    targets = tokens[:, 1:]
    valid = (targets > 0).astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * valid) / jnp.sum(valid)


def make_train_step(lr: float = 0.05, with_grads: bool = False):
    """A jitted SGD step ``(model, tokens, mask) -> loss`` (``(loss, grads)`` with ``with_grads``) that updates
    ``model`` in place."""
    import jax
    from flax import nnx

    @nnx.jit
    def step(model, tokens, mask):
        value, grads = nnx.value_and_grad(loss)(model, tokens, mask)
        nnx.update(model, jax.tree.map(lambda p, g: p - lr * g, nnx.state(model, nnx.Param), grads))
        return (value, grads) if with_grads else value

    return step


def frozen_losses(attention_fn, shape: DecoderShape, dropout_rate: float, steps: int = 3) -> list[float]:
    """The losses of ``steps`` jitted steps at learning rate 0 of a fresh decoder (the tests' check that the
    dropout model draws a new mask at every step: the parameters stay, so only the masks can change a loss)."""
    tokens, mask = batch(shape)
    step = make_train_step(lr=0.0)
    model = decoder(attention_fn, shape, dropout_rate=dropout_rate)
    return [float(step(model, tokens, mask)) for _ in range(steps)]


def _time_steps(step, model, tokens, mask, steps: int, rounds: int) -> tuple[float, float]:
    """Median ms per step over ``rounds`` chains of ``steps`` steps, and the last loss."""
    for _ in range(2):
        value = step(model, tokens, mask)
    value.block_until_ready()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            value = step(model, tokens, mask)
        value.block_until_ready()
        times.append((time.perf_counter() - start) * 1e3 / steps)
    return statistics.median(times), float(value)


def _decoder_shape(args) -> DecoderShape:
    shape = DecoderShape(batch=4, length=1024) if args.quick else DecoderShape()
    if args.shape:
        b, t, d, heads, layers = (int(n) for n in args.shape.split(","))
        shape = DecoderShape(batch=b, length=t, d_model=d, heads=heads, layers=layers, vocab=shape.vocab)
    return shape


def _flax_rows(args, dropout_rate: float, framework: str, what: str) -> list[Row]:
    from flax import nnx

    from cudnn_attn.jax_bridge import flax_attention_fn

    shape = _decoder_shape(args)
    case = f"{shape.layers}-layer d{shape.d_model} H{shape.heads} T{shape.length} B{shape.batch}, {what}"
    row = Row(framework, case)
    try:
        tokens, mask = batch(shape)
        step = make_train_step()
        ours_ms, ours_loss = _time_steps(step, decoder(flax_attention_fn(), shape, dropout_rate=dropout_rate),
                                         tokens, mask, args.steps, args.rounds)
        theirs_ms, theirs_loss = _time_steps(step, decoder(nnx.dot_product_attention, shape,
                                                           dropout_rate=dropout_rate),
                                             tokens, mask, args.steps, args.rounds)
        row.ours_ms, row.theirs_ms, row.ratio = ours_ms, theirs_ms, ours_ms / theirs_ms
        row.notes = {"theirs": "flax.nnx.dot_product_attention", "last_loss_ours": ours_loss,
                     "last_loss_theirs": theirs_loss, "steps": args.steps, "rounds": args.rounds,
                     "shape": asdict(shape), "dropout_rate": dropout_rate}
    except Exception as error:  # noqa: BLE001 -- a benchmark row reports its failure and the others go on
        row.error = f"{type(error).__name__}: {error}"
        traceback.print_exc()
    return [row]


def flax_section(args) -> list[Row]:
    return _flax_rows(args, 0.0, "flax", "padding masks")


def flax_dropout_section(args) -> list[Row]:
    return _flax_rows(args, 0.1, "flax", "padding masks, dropout 0.1")


def torch_section(args) -> list[Row]:
    """The torch rows: ``benchmarks/bench_torch.py``'s ``rows(quick)`` (a list of dicts with :class:`Row`'s
    keys), when that file exists and has it."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import bench_torch
    except ImportError:
        return []
    rows = getattr(bench_torch, "rows", None)
    return [Row(**r) for r in rows(quick=args.quick)] if rows else []


SECTIONS = {"flax": flax_section, "flax_dropout": flax_dropout_section, "torch": torch_section}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out", help="directory for bench_frameworks.json")
    parser.add_argument("--quick", action="store_true", help="B=4 T=1024")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed chain")
    parser.add_argument("--rounds", type=int, default=3, help="timed chains (median)")
    parser.add_argument("--shape", help="B,T,d_model,heads,layers instead of the default shape")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS))
    args = parser.parse_args()
    rows: list[Row] = []
    for name in args.sections.split(","):
        rows += SECTIONS[name](args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_frameworks.json"), "w") as f:
        json.dump({"quick": args.quick, "rows": [asdict(r) for r in rows]}, f, indent=2)
    print("\n== frameworks: training step, ms per step (ours / theirs: below 1 is faster)")
    print(f"{'framework':<10} {'case':<56} {'ours':>8} {'theirs':>8} {'ratio':>6}")
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.3f}"
        print(f"{r.framework:<10} {r.case:<56} {_ms(r.ours_ms):>8} {_ms(r.theirs_ms):>8} {ratio:>6}"
              + (f"  ERROR {r.error}" if r.error else ""))
    return int(any(r.error for r in rows))


if __name__ == "__main__":
    raise SystemExit(main())
