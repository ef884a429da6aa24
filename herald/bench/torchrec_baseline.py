"""The TorchRec baseline of the benchmarks: single-process TorchRec DLRM over FBGEMM's
table-batched embeddings, on the same rows, model and batch as plain PyTorch (docs/torchrec.md).

What is trained (:func:`train_torchrec`) is the plain-PyTorch baseline of
:mod:`herald.bench.common` written the way a TorchRec user writes it:

- ``torchrec.models.dlrm.DLRM`` (DenseArch, dot InteractionArch, OverArch) with the layer
  sizes of herald's DLRM (:func:`herald.worker.models.build_model`: bottom 64 -> dim,
  top 64 -> 32 -> 1), read from a :class:`~herald.bench.common.PlainDLRM` built with
  the same seed, whose dense weights *and* embedding rows are copied in: TorchRec and
  plain PyTorch start from the very same parameters;
- its sparse arch a ``FusedEmbeddingBagCollection``: one table per herald table, exactly
  ``table_rows[t]`` rows (the remapped ids of :func:`~herald.bench.common.load_plain_batches`),
  sum pooling, FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` with the sparse
  optimizer fused into backward. The optimizer is the plain baseline's by default:
  element-wise Adagrad (FBGEMM ``EXACT_ADAGRAD``; lr = herald's default sparse lr,
  eps = herald's Adagrad eps); ``sgd``, ``rowwise_adagrad`` and ``adam`` map to FBGEMM's
  ``EXACT_SGD``, ``EXACT_ROWWISE_ADAGRAD`` and ``ADAM`` (CUDA only: FBGEMM has no fused
  Adam on the CPU) and the e2e and network benches pass their ``--optimizer``;
- ``torch.optim.Adam`` (herald's default dense lr) on DenseArch and OverArch, mean BCE loss,
  1 torch thread, every batch turned into a ``KeyedJaggedTensor`` before the clock starts;
  the clock starts after ``warmup_steps`` steps, as the plain baseline's does.

With the default optimizer the two baselines train the same model: their losses agree to
float rounding (``tests/bench/test_torchrec_baseline.py``), so the gap between them is
FBGEMM's table-batched kernels and the fused update, not a different computation.

On a machine with CUDA the same runs on the GPU when FBGEMM's CUDA build is installed
(``fbgemm_gpu.__variant__`` is not ``cpu``); otherwise the entry says why it did not.
TorchRec is optional: without it (or with a build that fails to load) the entry is
``{"error": "torchrec not installed: make torchrec"}`` and the benches go on.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from herald.bench.common import WARMUP_STEPS, PlainBatches, PlainDLRM, load_plain_batches, timed_result
from herald.contracts.tables import OptimizerConfig
from herald.contracts.train import TrainConfig

# herald's sparse optimizers, every one fused into backward by FBGEMM: ``EXACT_SGD``,
# ``EXACT_ADAGRAD``, ``EXACT_ROWWISE_ADAGRAD`` and ``ADAM`` (CUDA only)
from herald.contracts.vocab import SPARSE_OPTIMIZERS
from herald.errors import ConfigError

TORCHREC_MISSING = "torchrec not installed: make torchrec"
FBGEMM_CUDA_MISSING = "fbgemm-gpu CUDA build not installed"


def torchrec_import_error() -> str | None:
    """None when ``torchrec`` and FBGEMM import, else the line the benches print
    (:data:`TORCHREC_MISSING`, with the import error when a build is installed but fails)."""
    try:
        import torchrec  # noqa: F401
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("torchrec", "fbgemm_gpu"):
            return TORCHREC_MISSING
        return f"{TORCHREC_MISSING} (an import failed: {exc})"
    except (ImportError, OSError, RuntimeError) as exc:  # e.g. an FBGEMM built for another torch
        return f"{TORCHREC_MISSING} (the installed build fails to load: {exc})"
    return None


def fbgemm_cuda_build() -> bool:
    """Whether the installed ``fbgemm_gpu`` is a GPU build (its ``__variant__`` is not ``cpu``)."""
    import fbgemm_gpu  # optional: imported only when a TorchRec run needs it

    return getattr(fbgemm_gpu, "__variant__", "cpu") != "cpu"


@dataclasses.dataclass
class TorchRecBatch:
    """One step's input on ``device``: ``dense float32 [B, D]``, ``labels float32 [B]``,
    ``features``: a ``KeyedJaggedTensor`` with keys ``f0 .. f{T-1}`` (values int64, lengths int64 [T*B])."""

    dense: torch.Tensor
    labels: torch.Tensor
    features: object


def to_torchrec_batches(data: PlainBatches, device: torch.device) -> list[TorchRecBatch]:
    """The plain baseline's batches as TorchRec input: per batch, the tables' ids
    concatenated table after table and their bag lengths (``diff`` of the offsets)."""
    # torchrec and FBGEMM are optional: imported only when a TorchRec run needs them
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = [f"f{t}" for t in range(len(data.table_rows))]
    out = []
    for dense, labels, ids, offsets in data.batches:
        lengths = [torch.diff(o, append=torch.tensor([i.shape[0]], dtype=o.dtype)) for i, o in zip(ids, offsets)]
        kjt = KeyedJaggedTensor(keys=keys, values=torch.cat(ids), lengths=torch.cat(lengths))
        out.append(TorchRecBatch(dense.to(device), labels.to(device), kjt.to(device)))
    return out


def _linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


def check_optimizer(name: str, device: str = "cpu") -> None:
    """Raise ConfigError unless FBGEMM fuses sparse optimizer ``name`` on ``device``
    (every one of :data:`SPARSE_OPTIMIZERS` on CUDA; all but ``adam`` on the CPU)."""
    if name not in SPARSE_OPTIMIZERS:
        raise ConfigError(
            f"the TorchRec baseline fuses one of {list(SPARSE_OPTIMIZERS)} into FBGEMM, got "
            f"{name!r}; pass --no-torchrec to leave it out"
        )
    if name == "adam" and torch.device(device).type == "cpu":
        raise ConfigError(
            "FBGEMM fuses Adam into backward only on CUDA; choose --optimizer sgd, adagrad or "
            "rowwise_adagrad, or pass --no-torchrec to leave the TorchRec baseline out"
        )


def _optimizer_type(name: str, device: torch.device) -> type:
    check_optimizer(name, str(device))
    if name == "rowwise_adagrad":
        # torchrec and FBGEMM are optional: imported only when a TorchRec run needs them
        from torchrec.optim import RowWiseAdagrad

        return RowWiseAdagrad
    return {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[name]


def build_torchrec_dlrm(
    data: PlainBatches, *, embedding_dim: int, seed: int, optimizer: str, device: torch.device
) -> nn.Module:
    """``torchrec.models.dlrm.DLRM`` over a ``FusedEmbeddingBagCollection`` holding the same
    parameters as ``PlainDLRM(data.dense_dim, data.table_rows, embedding_dim, seed)``.

    Raises:
        ConfigError: no dense features (TorchRec's DLRM needs them), or an optimizer FBGEMM
            does not fuse.
    """
    # torchrec and FBGEMM are optional: imported only when a TorchRec run needs them
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    if data.dense_dim < 1:
        raise ConfigError("TorchRec's DLRM needs dense features; this source has none: pass --no-torchrec")
    kwargs = {"lr": TrainConfig().embedding.lr}
    if optimizer != "sgd":
        kwargs["eps"] = OptimizerConfig(optimizer).eps
    plain = PlainDLRM(data.dense_dim, data.table_rows, embedding_dim, seed)
    tables = [
        EmbeddingBagConfig(name=f"t{t}", embedding_dim=embedding_dim, num_embeddings=n, feature_names=[f"f{t}"])
        for t, n in enumerate(data.table_rows)
    ]
    ebc = FusedEmbeddingBagCollection(
        tables=tables, optimizer_type=_optimizer_type(optimizer, device), optimizer_kwargs=kwargs, device=device
    )
    model = dlrm_with_dense_of(plain, ebc, data.dense_dim, device)
    with torch.no_grad():
        for bag, cfg in zip(plain.bags, tables):
            ebc.embedding_bags[cfg.name].weight.copy_(bag.weight)  # a view of FBGEMM's weights
    return model


def _dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [*model.dense_arch.parameters(), *model.over_arch.parameters()]


def _train_loop(
    model: nn.Module, batches: list[TorchRecBatch], warmup_steps: int, dense_lr: float
) -> tuple[list[float], float]:
    """Every step's loss, and the seconds of the steps after the first ``warmup_steps``
    (each step reads its loss, which waits for a GPU: the time is the device's)."""
    dense_opt = torch.optim.Adam(_dense_parameters(model), lr=dense_lr)
    losses, t0 = [], time.perf_counter()
    for step, b in enumerate(batches):
        if step == warmup_steps:
            t0 = time.perf_counter()
        loss = F.binary_cross_entropy_with_logits(model(b.dense, b.features).squeeze(1), b.labels)
        dense_opt.zero_grad()
        loss.backward()  # the embeddings' optimizer runs inside FBGEMM's backward
        dense_opt.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - t0


def train_torchrec(
    data: PlainBatches,
    *,
    embedding_dim: int = 16,
    seed: int = 0,
    device: str = "cpu",
    warmup_steps: int = WARMUP_STEPS,
    optimizer: str = "adagrad",
) -> dict:
    """Train a fresh :func:`build_torchrec_dlrm` once over ``data`` on ``device`` with
    1 torch thread (restored after); the clock starts after ``warmup_steps`` steps.

    Args:
        data: the plain baseline's batches (:func:`herald.bench.common.load_plain_batches`).
        embedding_dim: row width of every table; seed: the plain baseline's model seed.
        device: ``cpu`` or ``cuda`` (needs FBGEMM's CUDA build).
        optimizer: the fused sparse optimizer, one of :data:`SPARSE_OPTIMIZERS`
            (default: the plain baseline's element-wise Adagrad).

    Returns:
        ``{"samples_per_s", "timed_steps", "train_s", "losses"}`` (``losses``: every step's).

    Raises:
        ConfigError: torchrec missing, no step left to time after the warm-up, no dense
            features, or an optimizer FBGEMM does not fuse.
    """
    missing = torchrec_import_error()
    if missing:
        raise ConfigError(missing)
    if len(data.batches) <= warmup_steps:
        raise ConfigError(
            f"{len(data.batches)} batches leave nothing to time after {warmup_steps} warm-up "
            "steps; raise --rows or lower --batch-size"
        )
    dev = torch.device(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_torchrec_dlrm(data, embedding_dim=embedding_dim, seed=seed, optimizer=optimizer, device=dev)
        losses, train_s = _train_loop(model, to_torchrec_batches(data, dev), warmup_steps, TrainConfig().dense.lr)
    finally:
        torch.set_num_threads(threads)
    return timed_result(data, warmup_steps, losses, train_s)


def _cuda_entry(data: PlainBatches, kw: dict, repeats: int, gpu: bool) -> dict | str:
    if not gpu:
        return "not run (--no-gpu)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not fbgemm_cuda_build():
        return FBGEMM_CUDA_MISSING
    got = [train_torchrec(data, device="cuda", **kw)["samples_per_s"] for _ in range(repeats)]
    return {"samples_per_s": statistics.median(got), "repeats_samples_per_s": got}


def torchrec_baseline(
    data: PlainBatches,
    *,
    repeats: int = 1,
    seed: int = 0,
    embedding_dim: int = 16,
    optimizer: str = "adagrad",
    gpu: bool = True,
) -> dict:
    """The benches' ``"torchrec"`` entry: :func:`train_torchrec` on the CPU ``repeats``
    times (median), then on CUDA when ``gpu`` and a device and FBGEMM's CUDA build are there.

    Returns:
        ``{"samples_per_s", "repeats_samples_per_s", "timed_steps", "sparse_optimizer",
        "dense_optimizer", "cuda"}`` (``cuda``: ``{"samples_per_s", ...}`` or a string
        saying why it did not run), or ``{"error": ...}`` when torchrec is missing.
    """
    missing = torchrec_import_error()
    if missing:
        print(f"TorchRec: {missing}", flush=True)
        return {"error": missing}
    kw = {"embedding_dim": embedding_dim, "seed": seed, "optimizer": optimizer}
    got = [train_torchrec(data, **kw) for _ in range(repeats)]
    sps = statistics.median(g["samples_per_s"] for g in got)
    print(f"TorchRec (fused {optimizer}): {sps:,.0f} samples/s", flush=True)
    return {
        "samples_per_s": sps,
        "repeats_samples_per_s": [g["samples_per_s"] for g in got],
        "timed_steps": got[0]["timed_steps"],
        "sparse_optimizer": f"{optimizer}, fused into FBGEMM's backward",
        "dense_optimizer": "adam",
        "cuda": _cuda_entry(data, kw, repeats, gpu),
    }


def ratio_to(entry: dict | None, samples_per_s: float) -> float | None:
    """``samples_per_s`` over the TorchRec entry's, or None when it has no figure."""
    return samples_per_s / entry["samples_per_s"] if entry and entry.get("samples_per_s") else None


def describe(entry: dict | None) -> str:
    """One line for a bench's output: the CPU figure (and the CUDA one or why not), or the error."""
    if entry is None:
        return "TorchRec: not run (--no-torchrec)"
    if "error" in entry:
        return f"TorchRec: {entry['error']}"
    cuda = entry["cuda"]
    cuda_text = f"{cuda['samples_per_s']:,.0f} samples/s" if isinstance(cuda, dict) else cuda
    return f"TorchRec (1 process, 1 thread): CPU {entry['samples_per_s']:,.0f} samples/s; CUDA: {cuda_text}"


def format_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def check_bench_optimizer(optimizer: str, no_torchrec: bool) -> None:
    """A bench's early check, before any job runs: unless ``no_torchrec`` or torchrec is
    missing, FBGEMM must fuse ``optimizer`` on the CPU (:func:`check_optimizer`)."""
    if not no_torchrec and torchrec_import_error() is None:
        check_optimizer(optimizer, "cpu")


def torchrec_on_source(
    source: str,
    *,
    batch_size: int,
    eval_fraction: float,
    embedding_dim: int,
    optimizer: str,
    seed: int = 0,
    gpu: bool = True,
) -> dict:
    """:func:`torchrec_baseline` on the training split of ``source`` (what ``herald train``
    trains on with ``eval_fraction``), read as the plain baseline reads it, at
    ``batch_size`` samples per step; the entry gets ``batch_size`` and ``embedding_dim``.

    Raises:
        ConfigError: fewer training rows than one batch plus the warm-up, or ``optimizer``
            not fused by FBGEMM on the CPU.
    """
    missing = torchrec_import_error()
    if missing:
        print(f"TorchRec: {missing}", flush=True)
        return {"error": missing}
    data = load_plain_batches(source, batch_size, eval_fraction=eval_fraction)
    entry = torchrec_baseline(data, seed=seed, embedding_dim=embedding_dim, optimizer=optimizer, gpu=gpu)
    return {**entry, "batch_size": batch_size, "embedding_dim": embedding_dim}


def dlrm_with_dense_of(plain: PlainDLRM, ebc, dense_dim: int, device: torch.device):
    """TorchRec's ``DLRM`` over ``ebc`` with herald's dense layers (``plain``'s bottom and top
    MLPs) copied in, so both start from the same model.

    Raises:
        ConfigError: TorchRec's layer shapes do not match herald's (herald's DLRM changed).
    """
    from torchrec.models.dlrm import DLRM

    bottom, top = _linears(plain.dense.bottom), _linears(plain.dense.top)
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=dense_dim,
        dense_arch_layer_sizes=[lin.out_features for lin in bottom],
        over_arch_layer_sizes=[lin.out_features for lin in top],
        dense_device=device,
    )
    with torch.no_grad():
        for src, dst in zip(bottom + top, _linears(model.dense_arch) + _linears(model.over_arch)):
            if src.weight.shape != dst.weight.shape:
                raise ConfigError(
                    f"TorchRec's DLRM layer {tuple(dst.weight.shape)} does not match herald's "
                    f"{tuple(src.weight.shape)}; herald's DLRM changed: update {__name__}"
                )
            dst.weight.copy_(src.weight)
            dst.bias.copy_(src.bias)
    return model
