"""The planner against published training measurements (issue 45, item 4).

    python benchmarks/published.py [--markdown] [--only NAME ...] [--file PATH]

For every entry of ``benchmarks/published.yaml`` with a measured figure, the entry's model,
batch and layout become a jaxpar config and layout, the planner's estimate (the layout
lab's analytic estimate, ``jaxpar plan --analytic``: nothing compiled) prices one step on
the entry's hardware profile, and the predicted step time is converted to the unit the
source publishes, counting FLOPs the way the source does:

* ``megatron_eq3_with_recompute`` (Narayanan et al., SC'21, Eq. (3)): the FLOPs of one
  iteration are F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) (B global batch, s sequence,
  l layers, h hidden, V vocabulary; full recomputation counted); TFLOP/s per GPU =
  F / (step time · GPUs).
* ``maxtext_6N_plus_causal_attention`` (MaxText ``calculate_tflops_training_per_device`` at
  efb6d9e4): per device and step 6·N·S·b + 6·L·H·d_head·S²·b (b sequences per device,
  S their length, N every parameter of the pytree: both embedding tables, the four
  attention and three SwiGLU kernels and two norms per layer, the final norm); no
  recomputation counted; TFLOP/s per device = that / step time.
* ``nemo_model_flops_unspecified``: the formula is not published, so the prediction's
  tokens per second per GPU are scaled by the source's own FLOPs per token (its TFLOP/s
  over its tokens/s): predicted/published is the tokens-per-second ratio.

Megatron's layout (t, p, d, v, microbatch, global batch) maps onto ``mesh.tensor``,
``mesh.stage``, ``mesh.data`` (ZeRO-3 / FSDP degree onto ``mesh.fsdp``),
``pipeline.virtual_stages`` and ``pipeline.microbatches`` = global / (d·microbatch) with the
``interleaved`` schedule where v > 1 and ``1f1b`` otherwise, on the sub-mesh executor
(``pipeline.executor=mpmd``: a program per stage, as Megatron runs); without a pipeline, more than
one microbatch per step becomes ``train.grad_accum``. fp16 runs as bfloat16 (same peak).
``recompute: full`` is ``model.remat=full`` without a pipeline; in a pipeline it is
``model.remat=none``, because jaxpar's pipeline backward already recomputes each chunk from
its stashed input (Megatron's full recomputation: one forward again per microbatch), and
``model.remat=full`` there would run the forward a third time (``--literal-remat``: remat=full
everywhere). Megatron's 2021 attention, which writes the [s, s] scores and reads them back
(it predates FlashAttention), is ``model.attention=xla``; MaxText's and NeMo's fused
kernels are ``auto`` (cuDNN's flash attention on a GPU); Megatron's dropout (0.1 of the
hidden states and of the attention probabilities, its 2021 defaults) is ``model.dropout``
and ``model.attention_dropout``. MaxText's ``minimal_flash``
(weight-matmul outputs and the attention output saved) is ``save_matmuls_context``. Sets of
entries that compare layouts of one model (equal GPUs; one scheme over GPU counts) are
checked for whether the predicted order matches the published one, and the figures'
sweeps (no numbers published) against the paper's stated outcome. Results and their
reading: docs/published.md.
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import yaml

from jaxpar import JaxparError, load_config

# the layout lab's estimate without compiling: what ``jaxpar plan --analytic`` runs
from jaxpar.lab import analytic, hardware

YAML = Path(__file__).with_name("published.yaml")
GPT_KEYS = ["model.name=gpt", "model.positions=learned", "model.tie_embeddings=true"]
GPT_KEYS += ["model.attn_bias=true"]  # Megatron's linear layers have biases (Eq. (2))
LLAMA_KEYS = ["model.name=llama", "model.tie_embeddings=false"]
#: Megatron's and MaxText's recomputation → the closest model.remat (null: none stated)
REMAT = {"full": "full", "selective": "save_matmuls_context", None: "none"}
#: the source's attention → model.attention: the [s, s] scores materialized (XLA's
#: attention, whose scores the estimate's other kernels read and write) or a fused kernel
#: that keeps none (cuDNN's flash attention where it runs)
ATTENTION = {"materialized": "xla", "fused": "auto"}
EQ3 = "megatron_eq3_with_recompute"
MAXTEXT = "maxtext_6N_plus_causal_attention"


class Unmapped(Exception):
    """An entry whose layout cannot be written as a jaxpar layout (the row says why)."""


# ---- FLOPs as each source counts them --------------------------------------------------------
def megatron_eq3_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """SC'21 Eq. (3): one iteration's FLOPs (recomputation included), all GPUs."""
    h = hidden
    return 96 * batch * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))


def maxtext_params(model: dict) -> int:
    """N as MaxText counts it for a Llama (its parameter pytree): untied input and output
    embeddings, q/k/v/o, the three SwiGLU kernels and two RMSNorm scales per layer, and
    the final norm."""
    d, f, v = model["d_model"], model["d_ff"], model["vocab"]
    head = d // model["n_heads"]
    attention = d * head * (2 * model["n_heads"] + 2 * model["n_kv_heads"])
    return 2 * v * d + model["n_layers"] * (attention + 3 * d * f + 2 * d) + d


def maxtext_flops_per_device(model: dict, per_device_batch: int) -> float:
    """MaxText's training FLOPs per device and step: 6·N·S·b + 12·L·H·d_head·S²·b / 2."""
    s, b = model["seq_len"], per_device_batch
    head = model["d_model"] // model["n_heads"]
    weights = 6 * maxtext_params(model) * s * b
    attention = 12 * model["n_layers"] * model["n_heads"] * head * s * s * b / 2
    return weights + attention


def published_flops_per_gpu(entry: dict) -> float | None:
    """One step's FLOPs per GPU as the entry's source counts them (None: not published)."""
    m, lay, n = entry["model"], entry["layout"], entry["gpus"]
    formula = entry["measured"]["flops_formula"]
    if formula == EQ3:
        b = lay["global_batch"]
        return megatron_eq3_flops(b, m["seq_len"], m["n_layers"], m["d_model"], m["vocab"]) / n
    if formula == MAXTEXT:
        return maxtext_flops_per_device(m, lay["global_batch"] // n)
    return None


def tflops_per_gpu(entry: dict, step_s: float) -> float:
    """A step time in the entry's published unit, TFLOP/s per GPU (a source without a
    formula: tokens/s per GPU times its own TFLOP per token)."""
    flops = published_flops_per_gpu(entry)
    if flops is not None:
        return flops / step_s / 1e12
    measured, m = entry["measured"], entry["model"]
    tokens = entry["layout"]["global_batch"] * m["seq_len"] / (step_s * entry["gpus"])
    return tokens * measured["tflops_per_gpu"] / measured["tokens_per_s_per_gpu"]


def published_step_s(entry: dict) -> float:
    """The step time the published TFLOP/s per GPU implies."""
    return tflops_per_gpu(entry, 1.0) / entry["measured"]["tflops_per_gpu"]


# ---- the entry as a jaxpar config and layout ------------------------------------------------
def split(lay: dict) -> tuple[int, int, int]:
    """(t, p, v): Table 2's PTD-P rows give only t·p; the authors' scripts run those models
    with t = 8 (the 530B at p = 35 in Table 1, the 175B at p = 12 in Figures 12/18):
    assumed here, as is a non-interleaved schedule where v is not published."""
    t, p, v = lay.get("tensor"), lay.get("pipeline"), lay.get("interleave")
    if t is None and p is None and lay.get("model_parallel"):
        t, p = 8, lay["model_parallel"] // 8
    if t is None or p is None or lay.get("data") is None or lay.get("microbatch") is None:
        raise Unmapped("layout not published (t, p, d or microbatch unknown)")
    return t, p, v or 1


def layout_of(entry: dict) -> str:
    """The entry's jaxpar layout string."""
    lay, n = entry["layout"], entry["gpus"]
    t, p, v = split(lay)
    d, f, mb = lay["data"], lay.get("fsdp") or 1, lay["microbatch"]
    if t * p * d * f != n:
        raise Unmapped(f"t·p·d·fsdp = {t * p * d * f} ≠ {n} GPUs")
    steps, rest = divmod(lay["global_batch"], d * f * mb)
    if rest:
        raise Unmapped(f"global batch {lay['global_batch']} is not a multiple of d·mb")
    parts = [f"data={d}", f"fsdp={f}", f"tensor={t}", f"stage={p}"]
    if lay.get("ranks") == "megatron":
        parts += megatron_hosts(t, d, p, hardware.get_profile(entry["hardware"]).devices_per_host)
    if p > 1:
        schedule = "interleaved" if v > 1 else "1f1b"
        parts += [f"pipeline.schedule={schedule}", f"pipeline.microbatches={steps}"]
        # a program per stage, each action as soon as its input arrives (as Megatron runs)
        parts += [f"pipeline.virtual_stages={v}"] if v > 1 else []
        parts += ["pipeline.executor=mpmd"]
    elif steps > 1:
        parts.append(f"train.grad_accum={steps}")
    return ",".join(x for x in parts if not re.fullmatch(r"\w+=1", x))


def megatron_hosts(t: int, d: int, p: int, per_server: int) -> list[str]:
    """Megatron-LM's rank order (tensor innermost, then data, the pipeline outermost;
    consecutive ranks on one server of ``per_server`` GPUs) as the ``mesh.hosts_*`` that
    put the same degrees across servers; none where jaxpar's own order (the stages inside
    the data-parallel replicas) places them the same."""
    megatron = _across((("tensor", t), ("data", d), ("stage", p)), per_server)
    if megatron is None:
        raise Unmapped(
            f"Megatron's ranks with t={t}, d={d}, p={p}: a server of {per_server} GPUs would "
            "hold part of one group and part of the next, which mesh.hosts_* cannot name"
        )
    if megatron == _across((("tensor", t), ("stage", p), ("data", d)), per_server):
        return []
    return [f"mesh.hosts_{axis}={n}" for axis, n in megatron.items() if n > 1]


def _across(inner_first: tuple[tuple[str, int], ...], per_server: int) -> dict[str, int] | None:
    """How much of each axis's degree crosses servers when the axes fill servers of
    ``per_server`` devices innermost first, each keeping what room is left; None where a
    server would hold part of one group and part of the next."""
    room, across = per_server, {}
    for axis, degree in inner_first:
        local = math.gcd(degree, room)
        if local < min(degree, room):
            return None
        room //= local
        across[axis] = degree // local
    return dict(sorted(across.items()))


def remat_of(entry: dict, literal: bool = False) -> str:
    """The model.remat of the entry's recomputation: full recomputation in a pipeline is
    the executor's own (``none``) unless ``literal``."""
    recompute = entry["layout"].get("recompute")
    if recompute == "full" and not literal and split(entry["layout"])[1] > 1:
        return "none"
    return REMAT[recompute]


def overrides_of(entry: dict, literal: bool = False) -> list[str]:
    """The config overrides of the entry's model, sequence, batch and recomputation."""
    m, lay = entry["model"], entry["layout"]
    keys = GPT_KEYS if m["family"] == "gpt" else LLAMA_KEYS
    if m["family"] == "llama":
        keys = [*keys, f"model.n_kv_heads={m['n_kv_heads']}"]
    elif m["n_kv_heads"] != m["n_heads"]:
        raise Unmapped("a GPT with grouped-query attention")
    drops = [f"model.{k}={m[k]}" for k in ("dropout", "attention_dropout") if m.get(k)]
    if drops and m["family"] != "gpt":
        raise Unmapped(f"dropout in a {m['family']} (jaxpar's GPT drops out)")
    keys = [*keys, *drops]
    if entry.get("precision") == "fp8":  # FP8 weight matmuls, as NeMo's Transformer Engine
        keys = [*keys, "model.precision=fp8"]
    return [
        *keys,
        f"model.vocab_size={m['vocab']}",
        f"model.d_model={m['d_model']}",
        f"model.n_layers={m['n_layers']}",
        f"model.n_heads={m['n_heads']}",
        f"model.d_ff={m['d_ff']}",
        f"model.max_seq_len={m['seq_len']}",
        f"model.remat={remat_of(entry, literal)}",
        f"model.attention={ATTENTION[m['attention']]}",
        "model.dtype=bfloat16",  # fp16 and bf16 share the tensor-core peak
        "data.dataset=synthetic",
        f"data.seq_len={m['seq_len']}",
        f"train.batch_size={lay['global_batch']}",
    ]


# ---- estimate --------------------------------------------------------------------------------
@dataclass
class Result:
    """One entry: published and predicted, in the published unit (TFLOP/s per GPU)."""

    name: str
    gpus: int
    published: float
    layout: str = ""
    predicted: float | None = None
    fits: bool | None = None
    mem_gb: float | None = None
    bound: str = ""
    step_s: float | None = None
    published_step_s: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    hidden_s: float | None = None
    #: the estimate's FLOPs per device over the source's count (None: no formula)
    work: float | None = None
    seconds: float = 0.0
    error: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.published


def load(path: Path = YAML) -> list[dict]:
    return yaml.safe_load(path.read_text())


def measured(entries: list[dict]) -> list[dict]:
    """The entries with a published TFLOP/s figure."""
    return [e for e in entries if (e.get("measured") or {}).get("tflops_per_gpu")]


def predict(entry: dict, literal: bool = False) -> Result:
    """The planner's estimate of one entry, converted to its published unit."""
    res = Result(entry["name"], entry["gpus"], entry["measured"]["tflops_per_gpu"])
    start = time.perf_counter()
    try:
        res.layout = layout_of(entry)
        config = load_config([], overrides_of(entry, literal))
        hw = hardware.get_profile(entry["hardware"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # another framework's run: its processes are its own (Megatron's stages cross
            # servers, which jaxpar's sub-mesh executor, these rows' mapping, refuses)
            row = analytic.estimate(config, res.layout, hw, entry["gpus"], processes=False)
        res.error = row.error
    except (Unmapped, JaxparError) as err:
        res.error = str(err)
    res.seconds = time.perf_counter() - start
    if res.error:
        res.error = res.error.splitlines()[0]
        return res
    res.step_s, res.bound, res.fits = row.predicted_step_time_s, row.predicted_bound, row.fits
    res.mem_gb = row.mem_total_bytes / 1e9
    res.compute_s, res.comm_s = row.predicted_compute_s, row.predicted_comm_s
    res.hidden_s = row.predicted_hidden_s
    source = published_flops_per_gpu(entry)
    res.work = row.flops / source if row.flops and source else None
    res.predicted = tflops_per_gpu(entry, res.step_s)
    res.published_step_s = published_step_s(entry)
    return res


# ---- orders ----------------------------------------------------------------------------------
def short(name: str) -> str:
    return name.replace("megatron_sc21_", "").replace("maxtext_a3_", "maxtext_")


def order_sets(entries: list[dict]) -> dict[str, list[str]]:
    """Entries that compare layouts of one model, counted one way: at equal GPUs (Table 2's
    ZeRO-3 vs PTD-P), and one scheme's rows over GPU counts (names equal but for it)."""
    sets: dict[str, list[str]] = {}

    def key(e: dict) -> tuple:
        m = e["model"]
        shape = (m["family"], m["n_layers"], m["d_model"], m["d_ff"], m["vocab"])
        return shape, e["measured"]["flops_formula"], e["gpus"]

    for (_, _, n), group in itertools.groupby(sorted(entries, key=key), key=key):
        names = [e["name"] for e in group]
        if len(names) > 1:
            sets[f"{', '.join(short(x) for x in names)} (equal GPUs: {n})"] = names
    scheme: dict[str, list[str]] = {}
    for e in entries:
        scheme.setdefault(re.sub(r"_\d+(gpu|vm)$", "", e["name"]), []).append(e["name"])
    for stem, names in scheme.items():
        if len(names) > 2:
            sets[f"{short(stem)} over GPU counts"] = names
    return sets


def order_agreement(results: dict[str, Result], names: list[str]) -> tuple[int, int]:
    """(pairs whose predicted order matches the published one, pairs compared)."""
    rows = [results[x] for x in names if results[x].predicted is not None]
    pairs = list(itertools.combinations(rows, 2))
    same = sum((a.published > b.published) == (a.predicted > b.predicted) for a, b in pairs)
    return same, len(pairs)


def orders(results: dict[str, Result], sets: dict[str, list[str]], markdown: bool) -> str:
    lines = []
    for title, names in sets.items():
        same, total = order_agreement(results, names)
        pub = ", ".join(f"{results[x].published:g}" for x in names)
        pred = ", ".join(
            "—" if results[x].predicted is None else f"{results[x].predicted:.0f}" for x in names
        )
        if total == 0:
            verdict = "not compared (a layout was refused)"
        elif same == total:
            verdict = "order matches"
        else:
            verdict = f"order differs ({same} of {total} pairs agree)"
        prefix = "- " if markdown else ""
        lines.append(f"{prefix}{title}: published {pub}; predicted {pred}: {verdict}")
    return "\n".join(lines)


# ---- the figures' sweeps: the paper states the outcome, not the numbers ----------------------
CLAIMS = {
    "fig13": ("§5.4.1: the peak is at t = 8, p = 8", lambda pts: max(pts)[1] == (8, 8)),
    "fig14": (
        "§5.4.2: throughput decreases as p increases",
        lambda pts: (
            [x for x, _ in sorted(pts, key=lambda q: q[1][1])]
            == sorted((x for x, _ in pts), reverse=True)
        ),
    ),
}


def sweep_points(entry: dict, batch: int, literal: bool) -> list[tuple[float, tuple, str]]:
    """(predicted TFLOP/s per GPU, (t, p), refusal) of each configuration of a sweep."""
    points = []
    for change in entry["layout"]["sweep"]:
        layout = {**entry["layout"], **change, "global_batch": batch}
        if layout["data"] is None:
            layout["data"] = entry["gpus"] // (layout["tensor"] * layout["pipeline"])
        nan = {"tflops_per_gpu": float("nan"), "flops_formula": EQ3}
        res = predict({**entry, "layout": layout, "measured": nan}, literal)
        points.append((res.predicted or 0.0, (layout["tensor"], layout["pipeline"]), res.error))
    return points


def sweeps(entries: list[dict], literal: bool, markdown: bool) -> str:
    """Each figure's sweep, predicted, against the outcome the paper states."""
    lines = []
    for entry in entries:
        claim = next((v for k, v in CLAIMS.items() if f"_{k}_" in entry["name"]), None)
        if claim is None or not entry["layout"].get("sweep"):
            continue
        for batch in entry["layout"]["global_batch_sweep"]:
            pts = sweep_points(entry, batch, literal)
            got = ", ".join(f"t{t}·p{p} {x:.0f}" + (f" ({e})" if e else "") for x, (t, p), e in pts)
            verdict = "holds" if claim[1]([(x, tp) for x, tp, _ in pts]) else "does not hold"
            prefix = "- " if markdown else ""
            name = f"{short(entry['name'])}, batch {batch}"
            lines.append(f"{prefix}{name}: {got}; {claim[0]}: {verdict}")
    return "\n".join(lines)


# ---- output ----------------------------------------------------------------------------------
HEAD = (
    "entry",
    "GPUs",
    "layout",
    "published",
    "predicted",
    "pred/pub",
    "fits (GB)",
    "bound",
    "work ×",
    "step s: pub → pred",
    "comm s: exposed / hidden",
    "note",
)


def cells(r: Result) -> tuple[str, ...]:
    if r.error:
        return short(r.name), str(r.gpus), r.layout or "—", f"{r.published:g}", *"—" * 7, r.error
    return (
        short(r.name),
        str(r.gpus),
        r.layout,
        f"{r.published:g}",
        f"{r.predicted:.0f}",
        f"{r.ratio:.2f}",
        f"{'yes' if r.fits else 'no'} ({r.mem_gb:.0f})",
        r.bound,
        "—" if r.work is None else f"{r.work:.2f}",
        f"{r.published_step_s:.3g} → {r.step_s:.3g}",
        f"{r.comm_s:.3g} / {r.hidden_s:.3g}",
        "",
    )


def table(results: list[Result], markdown: bool) -> str:
    rows = [HEAD, *(cells(r) for r in results)]
    if markdown:
        lines = ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        return "\n".join([lines[0], "|" + "---|" * len(HEAD), *lines[1:]])
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEAD))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="Markdown tables")
    parser.add_argument("--only", nargs="*", default=None, help="entry names to run")
    parser.add_argument("--file", type=Path, default=YAML, help="the measurements")
    parser.add_argument(
        "--literal-remat",
        action="store_true",
        help="full recomputation → model.remat=full in a pipeline too (a third forward)",
    )
    args = parser.parse_args(argv)
    entries = load(args.file)
    if args.only:
        entries = [e for e in entries if e["name"] in args.only]
    start = time.perf_counter()
    results = [predict(e, args.literal_remat) for e in measured(entries)]
    print(table(results, args.markdown))
    print()
    print(orders({r.name: r for r in results}, order_sets(measured(entries)), args.markdown))
    print(sweeps(entries, args.literal_remat, args.markdown))
    took = time.perf_counter() - start
    print(f"\n{len(results)} entries and the sweeps estimated in {took:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
