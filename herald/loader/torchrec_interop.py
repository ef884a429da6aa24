"""TorchRec interop: herald's batches as ``KeyedJaggedTensor`` and back, pooled
embeddings as ``KeyedTensor`` (docs/torchrec.md).

TorchRec is optional: this module imports ``torch`` and ``torchrec`` only inside its
functions, so loader code that never converts does not load them, and a missing
torchrec is an ``ImportError`` naming the install (:data:`TORCHREC_HINT`).

NOTE [kjt layout]. A batch of ``B`` samples and ``T`` tables is one
``KeyedJaggedTensor`` with ``keys`` = the table names in order, ``stride`` = ``B``,
``lengths`` int32 [T x B] (table 0's ``B`` bag sizes, then table 1's, ...) and
``values`` int64 [sum nnz] (table 0's ids, then table 1's, ...), no weights. Ids are
uint64 in herald (docs/design.md, "Data model") and int64 in TorchRec: the conversion
keeps the 64 bits (``view``, never ``astype``), so an id >= 2^63 is a negative
int64 in the KJT and comes back unchanged. For the layout of
:class:`~herald.loader.batch.SampleBatch` (one ``offsets`` [B+1] per table) this is
``lengths[t*B:(t+1)*B] == diff(offsets[t])`` and ``values`` = the tables' ``values``
concatenated. Labels and dense features are not part of a KJT: ``from_kjt`` takes them
as arguments, and :func:`to_torchrec` gives TorchRec's own ``Batch`` of all three.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from herald.errors import DataError
from herald.loader.batch import OFFSET_DTYPE, SampleBatch

if TYPE_CHECKING:  # imported on use: torch and torchrec are not loaded by loader code
    import torch

#: The install that works (docs/torchrec.md): torchrec 1.8.0 declares an unpinned ``fbgemm-gpu``
#: dependency whose 1.9.0 wheel overwrites ``fbgemm-gpu-cpu==1.8.0`` and fails to load,
#: so torchrec itself is installed without its dependencies (``make torchrec`` does both).
TORCHREC_HINT = (
    "pip install fbgemm-gpu-cpu==1.8.0 tensordict torchmetrics pyre-extensions tqdm && "
    "pip install --no-deps torchrec==1.8.0   (or `make torchrec`; docs/torchrec.md)"
)


def _torchrec(what: str = "output='kjt'", instead: str = "use output='torch'"):
    """TorchRec's ``Batch`` and ``KeyedJaggedTensor`` classes.

    Raises:
        ImportError: torchrec (or its FBGEMM build) cannot be imported; the message
            names ``what`` needs it, the install command and ``instead``.
    """
    try:
        from torchrec.datasets.utils import Batch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except (ImportError, OSError) as exc:  # OSError: an FBGEMM library that does not load
        raise _missing(what, instead, exc) from exc
    return Batch, KeyedJaggedTensor


def _missing(what: str, instead: str, exc: BaseException) -> ImportError:
    return ImportError(
        f"{what} needs torchrec, which is not installed or does not load ({exc}); install it "
        f"with `{TORCHREC_HINT}` (a broken fbgemm-gpu: `pip uninstall -y fbgemm-gpu "
        f"fbgemm-gpu-cpu` first), or {instead}"
    )


def keyed_tensor_class():
    """TorchRec's ``KeyedTensor`` class. Raises: ImportError naming the install."""
    try:
        from torchrec.sparse.jagged_tensor import KeyedTensor
    except (ImportError, OSError) as exc:
        raise _missing("embedding(output='keyed_tensor')", "use output='tensor'", exc) from exc
    return KeyedTensor


def jagged_tensor_class():
    """TorchRec's ``JaggedTensor`` class. Raises: ImportError naming the install."""
    try:
        from torchrec.sparse.jagged_tensor import JaggedTensor
    except (ImportError, OSError) as exc:
        raise _missing("FeatureEmbeddings.to_jagged()", "use the PaddedSequence itself", exc) from exc
    return JaggedTensor


def kjt_from_arrays(names: Sequence[str], values: np.ndarray, lengths: np.ndarray, batch_size: int):
    """A ``KeyedJaggedTensor`` from numpy ``values`` uint64 [nnz] and ``lengths`` int64 [T x B]
    (NOTE [kjt layout]); ``batch_size`` B is its stride.

    Raises:
        ImportError: torchrec is not installed (:data:`TORCHREC_HINT`).
    """
    import torch

    _, kjt_cls = _torchrec("to_kjt()", "use SampleBatch.to_torch() for plain tensors")
    vals = torch.from_numpy(np.ascontiguousarray(values).view(np.int64))  # a fresh array: no copy needed
    lens = torch.from_numpy(np.ascontiguousarray(lengths, dtype=np.int32))
    # stride only where it cannot be inferred (no keys): lengths / keys gives it otherwise
    stride = {} if names else {"stride": int(batch_size)}
    return kjt_cls(keys=list(names), values=vals, lengths=lens, **stride)


def to_kjt(batch: SampleBatch):
    """``batch``'s sparse features as a ``torchrec.KeyedJaggedTensor`` (NOTE [kjt layout]).

    Args:
        batch: a :class:`~herald.loader.batch.SampleBatch`; per table uint64 values
            [nnz_t] and int64 offsets [B+1].

    Returns:
        ``KeyedJaggedTensor`` on the CPU: keys = ``batch.table_names``, values int64
        [sum nnz] (the ids' bits), lengths int32 [T x B], stride ``B``. The arrays are
        copies: changing the KJT does not change the batch.

    Raises:
        ImportError: torchrec is not installed (:data:`TORCHREC_HINT`).
    """
    b = len(batch)
    if not batch.num_tables:
        return kjt_from_arrays([], np.zeros(0, np.uint64), np.zeros(0, np.int64), b)
    lengths = np.diff(np.stack(batch.offsets), axis=1).ravel()
    return kjt_from_arrays(batch.table_names, np.concatenate(batch.values), lengths, b)


def _ids_of(kjt) -> np.ndarray:
    """uint64 [nnz]: the KJT's values with their bits kept (int64) or widened (int32 >= 0)."""
    import torch

    values = kjt.values().detach().to("cpu")
    if values.dtype == torch.int64:
        return values.numpy().view(np.uint64).copy()
    if values.dtype == torch.int32:
        if values.numel() and int(values.min()) < 0:
            raise DataError(
                "from_kjt: negative int32 ids cannot be uint64 ids; give int64 values (their bits are "
                "kept) or hash the raw values with herald.hashing"
            )
        return values.numpy().astype(np.uint64)
    raise DataError(f"from_kjt: KJT values must be int64 or int32 ids, got {values.dtype}; ids are never floats")


def _check_kjt(kjt) -> int:
    """The KJT's batch size ``B``, after checking herald can hold it losslessly."""
    if kjt.weights_or_none() is not None:
        raise DataError(
            "from_kjt: the KJT has per-id weights, which a SampleBatch cannot hold; drop them "
            "explicitly (KeyedJaggedTensor(keys, values, lengths=...)) if they are all 1"
        )
    if kjt.variable_stride_per_key():
        raise DataError(
            "from_kjt: the KJT has a variable batch size per key (VBE); a SampleBatch has one "
            "batch size for every table: expand it to one stride first"
        )
    return int(kjt.stride())


def from_kjt(
    kjt, labels: np.ndarray | torch.Tensor | None = None, dense: np.ndarray | torch.Tensor | None = None
) -> SampleBatch:
    """A :class:`~herald.loader.batch.SampleBatch` from a ``KeyedJaggedTensor``: the
    inverse of :func:`to_kjt` (NOTE [kjt layout]).

    Args:
        kjt: ``KeyedJaggedTensor`` with ``B`` = ``kjt.stride()`` samples, int64 values
            (bits kept: negative values are ids >= 2^63) or int32 values >= 0, no
            weights, one stride for every key. Any device (copied to the CPU).
        labels: float32 [B] (numpy or torch); default zeros.
        dense: float32 [B, D] (numpy or torch); default ``[B, 0]``.

    Returns:
        ``SampleBatch`` with table names = ``kjt.keys()``, per table uint64 values and
        int64 offsets [B+1].

    Raises:
        DataError: weights, variable stride, values of another dtype, negative int32
            ids, or labels / dense of another shape or dtype than above.
    """
    b = _check_kjt(kjt)
    names = list(kjt.keys())
    lengths = kjt.lengths().detach().to("cpu").numpy().astype(np.int64)
    if lengths.shape != (len(names) * b,):
        raise DataError(f"from_kjt: lengths has {lengths.shape[0]} entries, want keys x stride = {len(names) * b}")
    ids = _ids_of(kjt)
    offsets = np.zeros((len(names), b + 1), OFFSET_DTYPE)
    np.cumsum(lengths.reshape(len(names), b), axis=1, out=offsets[:, 1:])
    ends = np.concatenate([[0], np.cumsum(offsets[:, -1])])
    values = [ids[ends[t] : ends[t + 1]] for t in range(len(names))]
    return SampleBatch(
        _array(labels, np.zeros(b, np.float32), "labels", b),
        _array(dense, np.zeros((b, 0), np.float32), "dense", b),
        values,
        list(offsets),
        names,
    )


def _array(value: Any, default: np.ndarray, name: str, b: int) -> np.ndarray:
    """``value`` (numpy, or torch on any device) as numpy, checked to have ``b`` rows."""
    if value is None:
        return default
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().to("cpu").numpy()
    if not isinstance(value, np.ndarray):
        raise DataError(f"from_kjt: {name} must be a numpy array or a torch tensor, got {type(value).__name__}")
    if value.ndim == 0 or value.shape[0] != b:
        raise DataError(
            f"from_kjt: {name} has shape {value.shape}, the KJT holds {b} samples (its stride); "
            f"pass the {name} of the same batch"
        )
    return value


def to_torchrec(batch: SampleBatch):
    """``torchrec.datasets.utils.Batch``: ``dense_features`` float32 [B, D],
    ``sparse_features`` :func:`to_kjt` (keys = table names; values int64, the ids of
    each table in turn, bits of the uint64 ids; lengths int32 [T x B]) and ``labels``
    float32 [B]. It has ``pin_memory()`` and ``to(device)``.

    Raises:
        ImportError: torchrec is not installed (:data:`TORCHREC_HINT`).
    """
    batch_cls, _ = _torchrec()
    t = batch.to_torch()
    return batch_cls(dense_features=t["dense"], sparse_features=to_kjt(batch), labels=t["labels"])


def from_torchrec(tr_batch) -> SampleBatch:
    """The inverse of :func:`to_torchrec`: a ``torchrec.datasets.utils.Batch`` (dense
    float32 [B, D], a KJT, labels float32 [B]) as a :class:`SampleBatch`.

    Raises:
        DataError: as :func:`from_kjt`.
    """
    return from_kjt(tr_batch.sparse_features, tr_batch.labels, tr_batch.dense_features)


def keyed_pooled(pooled: torch.Tensor, table_names: Sequence[str]):
    """Sum-pooled embeddings ``[b, T, dim]`` as a ``torchrec.KeyedTensor``: what a
    TorchRec ``EmbeddingBagCollection`` returns, so a TorchRec model's dense part takes it.

    Args:
        pooled: float32 [b, T, dim] (autograd graph kept: the gradient of the
            KeyedTensor's values reaches ``pooled`` and through it herald's rows).
        table_names: ``T`` names, the keys.

    Returns:
        ``KeyedTensor`` with keys = ``table_names``, ``length_per_key`` = ``[dim] * T``,
        ``key_dim`` 1, values float32 [b, T x dim] (table t at columns ``t*dim:(t+1)*dim``).

    Raises:
        DataError: ``pooled`` is not 3-d or ``table_names`` has another length than T.
        ImportError: torchrec is not installed (:data:`TORCHREC_HINT`).
    """
    if pooled.dim() != 3 or pooled.shape[1] != len(table_names):
        raise DataError(f"keyed_pooled: pooled must be [b, T={len(table_names)}, dim], got {tuple(pooled.shape)}")
    b, t, dim = pooled.shape
    return keyed_tensor_class()(
        keys=list(table_names), length_per_key=[int(dim)] * t, values=pooled.reshape(b, t * dim), key_dim=1
    )
