"""MovieLens side features: genre bags, each sample's rating history, ml-100k user attributes.

NOTE [movielens side features]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``side_features=True`` (:class:`herald.loader.formats.raw.MovieLensSettings`) a
MovieLens source reads the side files beside its ratings file and serves, after
``user`` and ``item``, these tables (ids are uint64):

- ``genres`` (multi-hot): the movie's genres as indices into :data:`GENRES` (the order
  of ml-100k's ``u.genre``, 0 = ``unknown`` ... 18 = ``Western``, then 19 = ``IMAX``;
  ml-latest-small's ``Children`` is ``Children's`` = 4). ``(no genres listed)``, a
  movie missing from the side file, or a name not in :data:`GENRES` give no id there.
  Files: ``movies.csv`` beside ``ratings.csv``; ``u.item`` (latin-1, 19 genre flags)
  beside ``u.data``.
- ``history`` (sequence, multi-hot): the ids of the movies the same user rated strictly
  before this sample's timestamp (equal timestamps excluded: no look-ahead), oldest
  first, truncated to the most recent ``history_length``. The ids are the ``item``
  table's ids (the raw movie id), so the two can share one embedding table. It is
  built once at open from all good ratings sorted by (user, timestamp), so every
  position of the source (resume included) sees the same history.
- ml-100k only, from ``u.user`` (single-hot; a user missing from it has no id):
  ``age`` the MovieLens-1M bucket code (:data:`AGE_BUCKETS`: 1 = under 18, 18 = 18-24,
  25, 35, 45, 50, 56 = 56+), ``gender``, ``occupation`` and ``zip`` (its first 3
  characters) hashed by NOTE [id hash] (:mod:`herald.hashing`) with the table's index
  in the schema as salt (5, 6, 7).

A bad side-file row (wrong field count, a non-integer id, a bad flag or age, a repeated
id) is skipped and counted per file and reason (``stats["side_skipped"]``), never
raised; an unknown genre name is dropped and counted as ``unknown_genre``. How many
samples had a longer history than ``history_length`` is ``stats["history_truncated"]``.
"""

from __future__ import annotations

import csv
import dataclasses
import os

import numpy as np

from herald.errors import DataError
from herald.hashing import hash_value
from herald.loader.batch import KEY_DTYPE, OFFSET_DTYPE

GENRES = (
    "unknown",
    "Action",
    "Adventure",
    "Animation",
    "Children's",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
    "IMAX",
)
_GENRE_IDS = {**{name: i for i, name in enumerate(GENRES)}, "Children": GENRES.index("Children's")}
_NO_GENRES = "(no genres listed)"
#: MovieLens-1M age codes: each bucket's lower bound (1 = under 18).
AGE_BUCKETS = (1, 18, 25, 35, 45, 50, 56)
LATEST_TABLES = ("genres", "history")
ML100K_TABLES = ("genres", "history", "age", "gender", "occupation", "zip")
_EMPTY = np.zeros(0, KEY_DTYPE)


@dataclasses.dataclass
class SideFeatures:
    """The side tables of ``n`` samples: ``names``, per table ``values`` uint64 [nnz] and
    ``offsets`` int64 [n+1]; ``skipped`` file -> reason -> count; ``history_truncated``."""

    names: tuple[str, ...]
    values: list[np.ndarray]
    offsets: list[np.ndarray]
    skipped: dict[str, dict[str, int]]
    history_truncated: int


def _count(skipped: dict, file: str, reason: str) -> None:
    per_file = skipped.setdefault(file, {})
    per_file[reason] = per_file.get(reason, 0) + 1


def _side_path(ratings_path: str, name: str) -> str:
    path = os.path.join(os.path.dirname(os.path.abspath(ratings_path)), name)
    if not os.path.isfile(path):
        raise DataError(
            f"side_features=True needs {name} beside {ratings_path} (not found: {path}); put the "
            "dataset's side files there, or open the source without side_features",
            source=ratings_path,
        )
    return path


def age_bucket(age: int) -> int:
    """The MovieLens-1M code of ``age`` (years): the largest :data:`AGE_BUCKETS` entry <= it (1 below 18)."""
    return max([b for b in AGE_BUCKETS if b <= age] or [AGE_BUCKETS[0]])


def read_movies_csv(path: str, skipped: dict) -> dict[int, np.ndarray]:
    """``movieId -> genre ids`` (uint64 [k]) of ml-latest-small's ``movies.csv``."""
    name = os.path.basename(path)
    out: dict[int, np.ndarray] = {}
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        for row in csv.reader(f):
            if not row or row == ["movieId", "title", "genres"]:
                continue
            movie = _row_id(row, 3, out, skipped, name)
            if movie is None:
                continue
            ids = []
            for genre in row[2].strip().split("|"):
                if genre in ("", _NO_GENRES):
                    continue
                if genre in _GENRE_IDS:
                    ids.append(_GENRE_IDS[genre])
                else:
                    _count(skipped, name, "unknown_genre")
            out[movie] = np.asarray(ids, KEY_DTYPE)
    return out


def _row_id(fields: list[str], count: int, seen: dict, skipped: dict, name: str) -> int | None:
    """The id in the first of a side row's ``count`` fields, or None for a row to skip (counted
    in ``skipped`` under ``name``: ``field_count``, ``bad_id`` or ``duplicate_id``, an id already ``seen``)."""
    if len(fields) != count:
        _count(skipped, name, "field_count")
        return None
    try:
        value = int(fields[0])
    except ValueError:
        _count(skipped, name, "bad_id")
        return None
    if value < 0 or value in seen:
        _count(skipped, name, "bad_id" if value < 0 else "duplicate_id")
        return None
    return value


def _pipe_rows(path: str):
    """The ``|``-separated rows of an ml-100k side file (latin-1), empty lines left out."""
    with open(path, "rb") as f:
        text = f.read().decode("latin-1")
    for line in text.splitlines():
        if line.strip():
            yield line.split("|")


def read_u_item(path: str, skipped: dict) -> dict[int, np.ndarray]:
    """``movie id -> genre ids`` (uint64 [k]) from ml-100k's ``u.item`` (24 fields, the
    last 19 the genre flags in :data:`GENRES` order)."""
    name = os.path.basename(path)
    out: dict[int, np.ndarray] = {}
    for fields in _pipe_rows(path):
        movie = _row_id(fields, 24, out, skipped, name)
        if movie is None:
            continue
        flags = [f.strip() for f in fields[5:]]
        if any(f not in ("0", "1") for f in flags):
            _count(skipped, name, "bad_value")
            continue
        out[movie] = np.asarray([g for g, f in enumerate(flags) if f == "1"], KEY_DTYPE)
    return out


def read_u_user(path: str, skipped: dict, salts: tuple[int, int, int]) -> dict[int, tuple[int, int, int, int]]:
    """``user id -> (age code, gender id, occupation id, zip id)`` from ml-100k's ``u.user``;
    ``salts``: the schema indices of the gender, occupation and zip tables (NOTE [id hash])."""
    name = os.path.basename(path)
    out: dict[int, tuple[int, int, int, int]] = {}
    for fields in _pipe_rows(path):
        if len(fields) != 5:
            _count(skipped, name, "field_count")
            continue
        user_text, age_text, gender, occupation, zipcode = (f.strip() for f in fields)
        try:
            user, age = int(user_text), int(age_text)
        except ValueError:
            _count(skipped, name, "bad_id" if not user_text.isdigit() else "bad_value")
            continue
        if age < 0 or not gender or not occupation or not zipcode:
            _count(skipped, name, "bad_value")
            continue
        if user < 0 or user in out:
            _count(skipped, name, "bad_id" if user < 0 else "duplicate_id")
            continue
        out[user] = (
            age_bucket(age),
            hash_value(gender, salts[0]),
            hash_value(occupation, salts[1]),
            hash_value(zipcode[:3], salts[2]),
        )
    return out


def gather_runs(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Jagged rows ``src[starts[i] : starts[i] + lengths[i]]``: (values [sum(lengths)],
    offsets int64 [n+1]); ``starts``, ``lengths`` int64 [n]."""
    offsets = np.zeros(lengths.shape[0] + 1, OFFSET_DTYPE)
    np.cumsum(lengths, out=offsets[1:])
    owner = np.repeat(np.arange(lengths.shape[0]), lengths)
    pos = starts[owner] + (np.arange(offsets[-1]) - offsets[:-1][owner])
    return src[pos], offsets


def lookup_bags(keys: np.ndarray, table: dict[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The bag ``table[key]`` (uint64 [k], missing: empty) of every key (uint64 [n]) as a
    jagged (values uint64, offsets int64 [n+1])."""
    uniq, inverse = np.unique(keys, return_inverse=True)
    bags = [table.get(int(k), _EMPTY) for k in uniq]
    ulen = np.fromiter((b.shape[0] for b in bags), np.int64, len(bags))
    ustart = np.zeros(len(bags), np.int64)
    np.cumsum(ulen[:-1], out=ustart[1:])
    flat = np.concatenate(bags) if bags else _EMPTY
    return gather_runs(flat.astype(KEY_DTYPE), ustart[inverse], ulen[inverse])


def history(
    users: np.ndarray, timestamps: np.ndarray, items: np.ndarray, length: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Each sample's history (NOTE [movielens side features]).

    Args:
        users, items: uint64 [n] ids of the samples in serving order; timestamps: int64 [n]
        seconds; length: most ids kept per sample (the most recent), >= 1.

    Returns:
        (values uint64 [nnz]: ``items`` ids, offsets int64 [n+1], how many samples had more
        than ``length`` earlier ratings).
    """
    n = users.shape[0]
    by_user = np.lexsort((timestamps, users))  # stable: ties keep serving order
    u, t = users[by_user], timestamps[by_user]
    k = np.arange(n)
    new_user = np.ones(n, bool)
    new_user[1:] = u[1:] != u[:-1]
    new_run = new_user.copy()
    new_run[1:] |= t[1:] != t[:-1]
    user_start = np.maximum.accumulate(np.where(new_user, k, 0))
    run_start = np.maximum.accumulate(np.where(new_run, k, 0))  # first rating of the user at this timestamp
    earlier = run_start - user_start
    lengths_k = np.minimum(earlier, length)
    starts = np.empty(n, np.int64)
    lengths = np.empty(n, np.int64)
    starts[by_user] = run_start - lengths_k
    lengths[by_user] = lengths_k
    values, offsets = gather_runs(items[by_user], starts, lengths)
    return values, offsets, int(np.count_nonzero(earlier > length))


def side_features(
    ratings_path: str, ml100k: bool, users: np.ndarray, items: np.ndarray, timestamps: np.ndarray, history_length: int
) -> SideFeatures:
    """The side tables of the samples (``users``, ``items`` uint64 [n], ``timestamps`` int64 [n],
    serving order) of the ratings file ``ratings_path``: :data:`ML100K_TABLES` when ``ml100k``
    (``u.item``, ``u.user``), else :data:`LATEST_TABLES` (``movies.csv``).

    Raises:
        DataError: a side file is missing (the message names it).
    """
    skipped: dict[str, dict[str, int]] = {}
    if ml100k:
        movies = read_u_item(_side_path(ratings_path, "u.item"), skipped)
        salts = tuple(2 + ML100K_TABLES.index(t) for t in ("gender", "occupation", "zip"))
        people = read_u_user(_side_path(ratings_path, "u.user"), skipped, salts)  # type: ignore[arg-type]
    else:
        movies = read_movies_csv(_side_path(ratings_path, "movies.csv"), skipped)
    values, offsets = [], []
    v, o = lookup_bags(items, movies)
    values.append(v)
    offsets.append(o)
    v, o, truncated = history(users, timestamps, items, history_length)
    values.append(v)
    offsets.append(o)
    if ml100k:
        for j in range(4):
            column = {user: np.asarray([attrs[j]], KEY_DTYPE) for user, attrs in people.items()}
            v, o = lookup_bags(users, column)
            values.append(v)
            offsets.append(o)
    return SideFeatures(ML100K_TABLES if ml100k else LATEST_TABLES, values, offsets, skipped, truncated)
