"""MovieLens side features (NOTE [movielens side features]) on the real files in
../shared/data/movielens: genre bags, the no-look-ahead history, item/history key
equality, ml-100k user attributes, resume, the Parquet list-column round trip and
bad side-file rows."""

from __future__ import annotations

import bisect
import collections
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from herald import cli
from herald.errors import ConfigError, DataError
from herald.hashing import hash_value
from herald.loader import open_source
from herald.loader.conversion import convert
from herald.loader.formats.arrow import arrow_to_batch
from herald.loader.formats.movielens_side import GENRES, age_bucket
from herald.loader.formats.parquet import ParquetSource
from herald.loader.source import read_rows

from .resume_harness import check_source_resume

LATEST = "movielens/ml-latest-small/ratings.csv"
ML100K = "movielens/ml-100k/u.data"
G = {name: i for i, name in enumerate(GENRES)}


def load(path, **options):
    with open_source(path, side_features=True, **options) as s:
        return read_rows(s), s.stats, s.schema


def rows_of(batch, name):
    t = batch.table_names.index(name)
    v, o = batch.values[t], batch.offsets[t]
    return [v[o[i] : o[i + 1]].tolist() for i in range(len(batch))]


def ratings_of(path):
    """(user, item, timestamp) of every line of a ratings file, in file order."""
    out = []
    with open(path) as f:
        for line in f:
            if line.startswith("userId"):
                continue
            fields = line.replace("\t", ",").strip().split(",")
            out.append((int(fields[0]), int(fields[1]), int(fields[3])))
    return out


@pytest.fixture(scope="module")
def latest(data_dir):
    return load(data_dir / LATEST)


@pytest.fixture(scope="module")
def ml100k(data_dir):
    return load(data_dir / ML100K)


def first_genres(batch, movie):
    items = batch.values[batch.table_names.index("item")]
    return rows_of(batch, "genres")[int(np.flatnonzero(items == movie)[0])]


def test_schema_order_and_multi_hot_tables(data_dir, latest, ml100k):
    assert latest[2].table_names == ("user", "item", "genres", "history")
    assert ml100k[2].table_names == ("user", "item", "genres", "history", "age", "gender", "occupation", "zip")
    with open_source(data_dir / LATEST, side_features=True) as s:
        assert s.multi_hot_tables == {"genres", "history"}
    with open_source(data_dir / LATEST) as s:  # the switch is off by default: ratings only
        assert s.schema.table_names == ("user", "item") and s.multi_hot_tables == frozenset()
        assert "side_skipped" not in s.stats


def test_genre_bags_of_known_movies(latest, ml100k):
    batch = latest[0]
    # movies.csv: 1,Toy Story (1995),Adventure|Animation|Children|Comedy|Fantasy
    toy = [G["Adventure"], G["Animation"], G["Children's"], G["Comedy"], G["Fantasy"]]
    assert first_genres(batch, 1) == toy
    # 122888,Ben-hur (2016),(no genres listed): an empty bag
    assert first_genres(batch, 122888) == []
    # u.item: Toy Story flags Animation, Children's, Comedy; GoldenEye: Action, Adventure, Thriller
    assert first_genres(ml100k[0], 1) == [3, 4, 5]
    assert first_genres(ml100k[0], 2) == [G["Action"], G["Adventure"], G["Thriller"]]
    # the same movie has the same bag in every sample
    items = batch.values[1]
    bags = rows_of(batch, "genres")
    assert all(bags[i] == toy for i in np.flatnonzero(items == 1))


@pytest.mark.parametrize("which", ["latest", "ml100k"])
def test_history_holds_only_earlier_ratings_in_order(request, data_dir, which):
    batch, stats, _ = request.getfixturevalue(which)
    path = data_dir / (LATEST if which == "latest" else ML100K)
    per_user = collections.defaultdict(list)
    for line, (user, item, ts) in enumerate(ratings_of(path)):
        per_user[user].append((ts, line, item))
    for rows in per_user.values():
        rows.sort()
    users, items = batch.values[0], batch.values[1]
    timestamps = {(u, i): ts for u, rows in per_user.items() for ts, _, i in rows}
    histories = rows_of(batch, "history")
    truncated = 0
    for k in range(len(batch)):
        user, item = int(users[k]), int(items[k])
        ts = timestamps[(user, item)]
        rows = per_user[user]
        earlier = bisect.bisect_left(rows, (ts, -1, -1))  # ratings strictly before ts
        truncated += earlier > 50
        want = [i for _, _, i in rows[max(0, earlier - 50) : earlier]]
        assert histories[k] == want, f"sample {k} (user {user}, item {item}, ts {ts})"
        assert all(timestamps[(user, i)] < ts for i in histories[k])  # no look-ahead, ties excluded
    assert stats["history_truncated"] == truncated > 0


def test_history_ids_are_item_ids(latest):
    batch = latest[0]
    users, items = batch.values[0], batch.values[1]
    history = batch.values[batch.table_names.index("history")]
    assert history.dtype == items.dtype == np.uint64
    assert set(np.unique(history).tolist()) <= set(np.unique(items).tolist())
    # a user's second-rated movie holds the first one's item key, bit for bit
    user = users[0]
    own = np.flatnonzero(users == user)
    hist = rows_of(batch, "history")
    later = [k for k in own if hist[k]]
    assert hist[later[0]][0] == int(items[own[0]])


def test_equal_timestamps_are_not_in_each_others_history(data_dir, latest):
    batch = latest[0]
    seen = collections.defaultdict(list)
    for user, item, ts in ratings_of(data_dir / LATEST):
        seen[(user, ts)].append(item)
    user, ts = next(k for k, v in seen.items() if len(v) >= 3)
    hist = rows_of(batch, "history")
    items = batch.values[1]
    users = batch.values[0]
    for k in np.flatnonzero((users == user) & np.isin(items, seen[(user, ts)])):
        assert not set(hist[k]) & set(seen[(user, ts)])


def test_history_length_truncates_to_the_most_recent(data_dir, latest):
    short, stats, _ = load(data_dir / LATEST, history_length=5)
    full = rows_of(latest[0], "history")
    cut = rows_of(short, "history")
    assert all(c == f[-5:] for c, f in zip(cut, full))
    assert stats["history_truncated"] == sum(len(f) > 5 for f in full)


def test_ml100k_user_attributes(ml100k):
    batch = ml100k[0]
    k = int(np.flatnonzero(batch.values[0] == 1)[0])  # u.user: 1|24|M|technician|85711
    got = {n: rows_of(batch, n)[k] for n in ("age", "gender", "occupation", "zip")}
    assert got == {
        "age": [18],
        "gender": [hash_value("M", 5)],
        "occupation": [hash_value("technician", 6)],
        "zip": [hash_value("857", 7)],
    }
    assert [age_bucket(a) for a in (7, 17, 18, 24, 25, 44, 45, 49, 50, 55, 56, 73)] == [
        1, 1, 18, 18, 25, 35, 45, 45, 50, 50, 56, 56
    ]  # fmt: skip
    for n in ("age", "gender", "occupation", "zip"):
        assert batch.is_single_hot(batch.table_names.index(n))


@pytest.mark.parametrize("rel", [LATEST, ML100K])
def test_resume_gives_the_same_rows_and_history(data_dir, rel):
    check_source_resume(lambda: open_source(data_dir / rel, side_features=True), trials=3, max_read=5000)


@pytest.mark.parametrize("rel", [LATEST, ML100K])
def test_parquet_list_round_trip(data_dir, tmp_path, rel):
    dst = tmp_path / "ml.parquet"
    out = convert(data_dir / rel, dst, progress=False, row_group_rows=30000, side_features=True)
    assert out["source"]["side_skipped"] == {}
    schema = pq.read_schema(dst)
    assert schema.field("genres").type == pa.list_(pa.uint64())
    assert schema.field("history").type == pa.list_(pa.uint64())
    assert schema.field("user").type == pa.uint64() and schema.field("item").type == pa.uint64()
    want = load(data_dir / rel)[0]
    with ParquetSource(dst) as p:
        assert p.multi_hot_tables == {"genres", "history"}
        got = read_rows(p)
    assert got.equals(want)


def test_null_list_is_an_empty_bag():
    table = pa.table(
        {
            "label": pa.array([1.0, 0.0, 1.0], pa.float32()),
            "item": pa.array([7, 8, 9], pa.uint64()),
            "genres": pa.array([[1, 2], None, [3]], pa.list_(pa.uint64())),
        }
    )
    batch = arrow_to_batch(table)
    assert batch.offsets[1].tolist() == [0, 2, 2, 3] and batch.values[1].tolist() == [1, 2, 3]
    # a record batch, as a Kafka Arrow record decodes, reads the same
    assert arrow_to_batch(table.to_batches()[0]).equals(batch)


def test_bad_side_file_rows_are_counted_not_raised(data_dir, tmp_path):
    src = data_dir / "movielens/ml-latest-small"
    shutil.copy(src / "ratings.csv", tmp_path / "ratings.csv")
    text = (src / "movies.csv").read_text()
    bad = [
        "abc,Not An Id (2000),Comedy",  # bad_id
        "5",  # field_count
        "1,Toy Story again,Drama",  # duplicate_id: the first row is kept
        '2,"Jumanji, typo",Cartoon|Comedy',  # duplicate_id as well
        "999999,Nobody Rated This,Cartoon|Comedy",  # unknown_genre: Cartoon dropped, Comedy kept
    ]
    (tmp_path / "movies.csv").write_text(text.rstrip("\r\n") + "\r\n" + "\r\n".join(bad) + "\r\n")
    batch, stats, _ = load(tmp_path / "ratings.csv")
    assert stats["side_skipped"] == {
        "movies.csv": {"bad_id": 1, "field_count": 1, "duplicate_id": 2, "unknown_genre": 1}
    }
    assert len(batch) == 100836
    assert first_genres(batch, 1) == [G["Adventure"], G["Animation"], G["Children's"], G["Comedy"], G["Fantasy"]]


def test_bad_ml100k_side_rows_are_counted(data_dir, tmp_path):
    src = data_dir / "movielens/ml-100k"
    shutil.copy(src / "u.data", tmp_path / "u.data")
    items = (src / "u.item").read_bytes().decode("latin-1").splitlines()
    items[0] = items[0].rsplit("|", 1)[0]  # Toy Story: 23 fields
    items[1] = items[1][:-1] + "x"  # GoldenEye: a flag that is not 0/1
    (tmp_path / "u.item").write_bytes(("\n".join(items) + "\n").encode("latin-1"))
    users = (src / "u.user").read_text().splitlines()
    users[0] = "1|twenty|M|technician|85711"  # bad age
    (tmp_path / "u.user").write_text("\n".join(users + ["x|20|F|writer|12345", "2|30|F"]) + "\n")
    batch, stats, _ = load(tmp_path / "u.data")
    assert stats["side_skipped"] == {
        "u.item": {"field_count": 1, "bad_value": 1},
        "u.user": {"bad_value": 1, "bad_id": 1, "field_count": 1},
    }
    assert len(batch) == 100000
    assert first_genres(batch, 1) == [] and first_genres(batch, 2) == []  # skipped movies: no genres
    k = int(np.flatnonzero(batch.values[0] == 1)[0])
    assert all(rows_of(batch, n)[k] == [] for n in ("age", "gender", "occupation", "zip"))


def test_missing_side_file_and_bad_settings(data_dir, tmp_path):
    shutil.copy(data_dir / LATEST, tmp_path / "ratings.csv")
    with pytest.raises(DataError, match="movies.csv"):
        open_source(tmp_path / "ratings.csv", side_features=True)
    with pytest.raises(ConfigError, match="history_length"):
        open_source(data_dir / LATEST, side_features=True, history_length=0)
    with pytest.raises(ConfigError, match="side_features"):
        open_source(data_dir / LATEST, side_features="yes")


def test_convert_cli_passes_source_options(data_dir, tmp_path, capsys):
    dst = tmp_path / "ml.parquet"
    args = [
        "convert",
        str(data_dir / ML100K),
        str(dst),
        "--quiet",
        "--source-option",
        "side_features=true",
        "--source-option",
        "history_length=10",
    ]
    assert cli.main(args) == 0
    assert "histories truncated" in capsys.readouterr().out
    with ParquetSource(dst) as p:
        got = read_rows(p)
    assert got.equals(load(data_dir / ML100K, history_length=10)[0])
