"""Tests for the lazy tokenized-dataset readers in `dflash_cache.data.dataset`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_cache.data.dataset import Row, from_table, open_dataset
from dflash_cache.errors import UserError

RNG = np.random.default_rng(0)
LENGTHS = [int(x) for x in RNG.integers(1, 40, size=25)]
IDS = [RNG.integers(0, 100, size=n).tolist() for n in LENGTHS]
MASKS = [RNG.integers(0, 2, size=n).tolist() for n in LENGTHS]


def make_table(ids=IDS, masks=MASKS, *, labels: bool = False, extra: bool = True) -> pa.Table:
    cols: dict = {"input_ids": pa.array(ids, type=pa.list_(pa.int32()))}
    if labels:
        cols["labels"] = pa.array([[t if m else -100 for t, m in zip(i, mk, strict=True)] for i, mk in zip(ids, masks, strict=True)])
    else:
        cols["loss_mask"] = pa.array(masks, type=pa.list_(pa.int8()))
    if extra:
        cols["text"] = pa.array([f"row {i}" for i in range(len(ids))])
    return pa.table(cols)


def write_hf(root: Path, table: pa.Table, splits: list[int], *, stream: bool = True) -> Path:
    """Write a save_to_disk-style directory: data-XXXXX-of-YYYYY.arrow files plus state.json."""
    root.mkdir(parents=True)
    names, start = [], 0
    bounds = [*splits, table.num_rows]
    for k, stop in enumerate(bounds):
        name = f"data-{k:05d}-of-{len(bounds):05d}.arrow"
        part = table.slice(start, stop - start)
        opener = pa.ipc.new_stream if stream else pa.ipc.new_file
        with pa.OSFile(str(root / name), "wb") as sink, opener(sink, table.schema) as writer:
            for batch in part.to_batches(max_chunksize=4):
                writer.write_batch(batch)
        names.append({"filename": name})
        start = stop
    (root / "state.json").write_text(json.dumps({"_data_files": names}))
    (root / "dataset_info.json").write_text("{}")
    return root


def write_parquet(root: Path, table: pa.Table, splits: list[int], row_group_size: int = 4) -> Path:
    root.mkdir(parents=True)
    start = 0
    for k, stop in enumerate([*splits, table.num_rows]):
        pq.write_table(table.slice(start, stop - start), root / f"part-{k:03d}.parquet", row_group_size=row_group_size)
        start = stop
    return root


def write_jsonl(path: Path, rows: list[dict], *, blank_lines: bool = True) -> Path:
    lines = [json.dumps(r) for r in rows]
    text = ("\n\n" if blank_lines else "\n").join(lines) + "\n"
    path.write_text(text)
    return path


def jsonl_rows(labels: bool = False) -> list[dict]:
    return make_table(labels=labels).to_pylist()


@pytest.fixture(params=["hf", "hf_file_format", "parquet", "parquet_file", "jsonl", "jsonl_dir", "memory"])
def source(request, tmp_path: Path):
    table = make_table()
    kind = request.param
    if kind == "hf":
        return write_hf(tmp_path / "ds", table, [7, 15])
    if kind == "hf_file_format":
        return write_hf(tmp_path / "ds", table, [10], stream=False)
    if kind == "parquet":
        return write_parquet(tmp_path / "pq", table, [6, 13])
    if kind == "parquet_file":
        pq.write_table(table, tmp_path / "one.parquet", row_group_size=5)
        return tmp_path / "one.parquet"
    if kind == "jsonl":
        return write_jsonl(tmp_path / "rows.jsonl", jsonl_rows())
    if kind == "jsonl_dir":
        (tmp_path / "j").mkdir()
        rows = jsonl_rows()
        write_jsonl(tmp_path / "j" / "a.jsonl", rows[:9])
        write_jsonl(tmp_path / "j" / "b.jsonl", rows[9:], blank_lines=False)
        return tmp_path / "j"
    return table


def assert_rows(rows: list[Row], indices) -> None:
    assert [r.index for r in rows] == list(indices)
    for r in rows:
        assert r.input_ids.dtype == np.int32 and r.loss_mask.dtype == np.uint8
        np.testing.assert_array_equal(r.input_ids, IDS[r.index][: len(r.input_ids)])
        np.testing.assert_array_equal(r.loss_mask, MASKS[r.index][: len(r.loss_mask)])


def test_round_trip_every_format(source) -> None:
    ds = open_dataset(source)
    assert ds.num_rows == len(IDS)
    scan = ds.scan(vocab_size=100, max_len=None)
    np.testing.assert_array_equal(scan.lengths, LENGTHS)
    np.testing.assert_array_equal(scan.supervised, [sum(m) for m in MASKS])
    assert scan.keep.all() and scan.truncated == 0 and scan.skipped == 0
    rows = ds.read_rows(0, ds.num_rows, max_len=None)
    assert_rows(rows, range(len(IDS)))
    assert [len(r.input_ids) for r in rows] == LENGTHS
    # ranges crossing row-group, batch and file boundaries
    for start, stop in [(3, 11), (5, 9), (12, 17), (0, 1), (24, 25), (8, 8)]:
        assert_rows(ds.read_rows(start, stop, max_len=None), range(start, stop))
    assert isinstance(ds.description, str) and ds.description
    assert len(ds.fingerprint) == 64


def test_labels_become_loss_mask(tmp_path: Path) -> None:
    table = make_table(labels=True)
    for spec in (table, write_jsonl(tmp_path / "l.jsonl", jsonl_rows(labels=True))):
        ds = open_dataset(spec)
        np.testing.assert_array_equal(ds.scan(vocab_size=None, max_len=None).supervised, [sum(m) for m in MASKS])
        assert_rows(ds.read_rows(0, ds.num_rows, max_len=None), range(len(IDS)))


def test_bool_loss_mask() -> None:
    table = pa.table({"input_ids": [[1, 2, 3]], "loss_mask": [[True, False, True]]})
    (row,) = from_table(table).read_rows(0, 1, max_len=None)
    np.testing.assert_array_equal(row.loss_mask, [1, 0, 1])


def test_limit(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "pq", make_table(), [6, 13])
    ds = open_dataset(path, limit=10)
    assert ds.num_rows == 10
    assert len(ds.scan(vocab_size=None, max_len=None).lengths) == 10
    assert_rows(ds.read_rows(0, 10, max_len=None), range(10))
    assert open_dataset(path, limit=1000).num_rows == len(IDS)
    with pytest.raises(ValueError):
        ds.read_rows(5, 11, max_len=None)


def test_max_len_truncate_and_skip(tmp_path: Path) -> None:
    ds = open_dataset(write_hf(tmp_path / "ds", make_table(), [7, 15]))
    max_len = 20
    over = np.array(LENGTHS) > max_len
    assert over.any() and not over.all()

    scan = ds.scan(vocab_size=100, max_len=max_len, overlong="truncate")
    np.testing.assert_array_equal(scan.lengths, np.minimum(LENGTHS, max_len))
    np.testing.assert_array_equal(scan.supervised, [sum(m[:max_len]) for m in MASKS])
    assert scan.truncated == int(over.sum()) and scan.skipped == 0 and scan.keep.all()
    rows = ds.read_rows(0, ds.num_rows, max_len=max_len)
    assert_rows(rows, range(len(IDS)))
    assert [len(r.input_ids) for r in rows] == scan.lengths.tolist()

    scan = ds.scan(vocab_size=100, max_len=max_len, overlong="skip")
    np.testing.assert_array_equal(scan.keep, ~over)
    np.testing.assert_array_equal(scan.lengths, np.where(over, 0, LENGTHS))
    np.testing.assert_array_equal(scan.supervised, [0 if o else sum(m) for o, m in zip(over, MASKS, strict=True)])
    assert scan.skipped == int(over.sum()) and scan.truncated == 0
    rows = ds.read_rows(2, 20, max_len=max_len, overlong="skip")
    assert_rows(rows, [i for i in range(2, 20) if not over[i]])
    assert all(len(r.input_ids) == LENGTHS[r.index] for r in rows)

    long_rows = from_table(pa.table({"input_ids": [[1, 2], [3, 4, 5]], "loss_mask": [[1, 1], [0, 1, 1]]}))
    with _one_line_error(r"all 2 rows are longer than max_len 1"):
        long_rows.scan(vocab_size=None, max_len=1, overlong="skip")


def test_dataset_dict_uses_train_split(tmp_path: Path) -> None:
    root = tmp_path / "dd"
    write_hf(root / "train", make_table(), [12])
    write_hf(root / "test", make_table().slice(0, 3), [])
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    ds = open_dataset(root)
    assert ds.num_rows == len(IDS) and "train" in ds.description
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["validation", "test"]}))
    import shutil

    shutil.rmtree(root / "train")
    with _one_line_error(r"no train split \(splits: validation, test\)"):
        open_dataset(root)


def test_fingerprint(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "pq", make_table(), [6, 13])
    fp = open_dataset(path).fingerprint
    assert open_dataset(path).fingerprint == fp
    assert open_dataset(path, limit=5).fingerprint != fp
    table = make_table()
    assert from_table(table).fingerprint == open_dataset(make_table()).fingerprint
    changed = [list(r) for r in IDS]
    changed[3][0] = (changed[3][0] + 1) % 100
    assert from_table(make_table(changed)).fingerprint != from_table(table).fingerprint
    pq.write_table(make_table(changed).slice(0, 6), path / "part-000.parquet", row_group_size=4)
    assert open_dataset(path).fingerprint != fp


class _one_line_error:
    """pytest.raises(UserError, match=...) that also checks the message is one line."""

    def __init__(self, match: str) -> None:
        self.ctx = pytest.raises(UserError, match=match)

    def __enter__(self):
        self.info = self.ctx.__enter__()
        return self.info

    def __exit__(self, *exc):
        result = self.ctx.__exit__(*exc)
        assert "\n" not in str(self.info.value)
        return result


def test_a_hub_name_says_that_only_local_datasets_are_read_and_how_to_save_one(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with _one_line_error(r"--data HuggingFaceH4/ultrachat_200k looks like a Hugging Face Hub name, but only local "
                         r"datasets are read; save it first: .*load_dataset\('HuggingFaceH4/ultrachat_200k', "
                         r"split='train'\)\.save_to_disk\('data/ultrachat_200k'\).*--data data/ultrachat_200k"):
        open_dataset(Path("HuggingFaceH4/ultrachat_200k"))
    with _one_line_error("dataset path data/rows.parquet does not exist"):  # a missing file is just missing
        open_dataset(Path("data/rows.parquet"))
    (tmp_path / "data").mkdir()
    with _one_line_error("dataset path data/sharegpt does not exist"):  # a local folder's typo, not a Hub name
        open_dataset(Path("data/sharegpt"))


def test_bad_paths(tmp_path: Path) -> None:
    with _one_line_error("does not exist"):
        open_dataset(tmp_path / "nope")
    (tmp_path / "x.csv").write_text("a,b\n")
    with _one_line_error(r"unrecognised dataset file .*parquet"):
        open_dataset(tmp_path / "x.csv")
    (tmp_path / "empty").mkdir()
    with _one_line_error("unrecognised dataset directory"):
        open_dataset(tmp_path / "empty")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with _one_line_error("cannot read Parquet file"):
        open_dataset(tmp_path / "bad.parquet")
    (tmp_path / "bad.arrow").write_bytes(b"garbage bytes here")
    with _one_line_error("cannot read Arrow file"):
        open_dataset(tmp_path / "bad.arrow")
    (tmp_path / "bad.jsonl").write_text('{"input_ids": [1], "loss_mask": [1]}\n{not json\n')
    with _one_line_error(r"row 1 \(bad.jsonl\): invalid JSON"):
        open_dataset(tmp_path / "bad.jsonl").scan(vocab_size=None, max_len=None)
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    with _one_line_error("not an object"):
        open_dataset(tmp_path / "list.jsonl")


def test_bad_arguments() -> None:
    ds = from_table(make_table())
    with _one_line_error("--limit must be a positive"):
        open_dataset(make_table(), limit=0)
    with _one_line_error("max_len must be a positive"):
        ds.scan(vocab_size=None, max_len=0)
    with _one_line_error("max_len must be a positive"):
        ds.read_rows(0, 1, max_len=-3)
    with _one_line_error("unknown overlong policy 'drop'"):
        ds.scan(vocab_size=None, max_len=10, overlong="drop")
    with _one_line_error("has no rows"):
        from_table(make_table().slice(0, 0))


def test_missing_columns(tmp_path: Path) -> None:
    with _one_line_error(r"no input_ids column \(found: text, tokens\); expected input_ids plus loss_mask or labels"):
        from_table(pa.table({"text": ["a"], "tokens": [[1]]}))
    with _one_line_error(r"no loss_mask or labels column \(found: input_ids, text\)"):
        from_table(pa.table({"input_ids": [[1]], "text": ["a"]}))
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "t.parquet")
    with _one_line_error("no input_ids column"):
        open_dataset(tmp_path / "t.parquet")


@pytest.mark.parametrize(
    ("columns", "match"),
    [
        ({"input_ids": [["a", "b"]], "loss_mask": [[1, 1]]}, r"input_ids must be a list of integers.*list<.*string>"),
        ({"input_ids": [[1.5, 2.0]], "loss_mask": [[1, 1]]}, r"input_ids must be a list of integers.*double"),
        ({"input_ids": [[[1], [2]]], "loss_mask": [[1, 1]]}, r"input_ids must be a list of integers.*list<item: list"),
        ({"input_ids": ["12"], "loss_mask": [[1, 1]]}, r"input_ids must be a list of integers.*type is string"),
        ({"input_ids": [[1, 2]], "loss_mask": [["y", "n"]]}, r"loss_mask must be a list of ints or bools"),
        ({"input_ids": [[1, 2]], "loss_mask": [[0.0, 1.0]]}, r"loss_mask must be a list of ints or bools"),
        ({"input_ids": [[1, 2], [3, 4]], "loss_mask": [[1, 0], [1, 2]]}, r"row 1: loss_mask value 2 is not 0 or 1"),
        ({"input_ids": [[1, 2], []], "loss_mask": [[1, 0], []]}, r"row 1: input_ids is empty"),
        ({"input_ids": [[1, 2], None], "loss_mask": [[1, 0], [1]]}, r"row 1: input_ids is null"),
        ({"input_ids": [[1, 2]], "loss_mask": [None]}, r"row 0: loss_mask is null"),
        ({"input_ids": [[1, None]], "loss_mask": [[1, 1]]}, r"row 0: input_ids contains a null"),
        ({"input_ids": [[1], [1, 2, 3]], "loss_mask": [[1], [1, 1]]}, r"row 1: input_ids has 3 tokens but loss_mask has 2"),
        ({"input_ids": [[1], [1, 2, 3]], "labels": [[1], [1, -100]]}, r"row 1: input_ids has 3 tokens but labels has 2"),
        ({"input_ids": [[1, 2]], "labels": [["a", "b"]]}, r"labels must be a list of integers"),
        ({"input_ids": [[1, -4]], "loss_mask": [[1, 1]]}, r"row 0: token id -4 is negative"),
    ],
)
def test_bad_values(columns: dict, match: str) -> None:
    with _one_line_error(match):
        from_table(pa.table(columns)).scan(vocab_size=None, max_len=None)


def test_vocab_out_of_range_names_row_id_and_vocab(tmp_path: Path) -> None:
    ids = [list(r) for r in IDS]
    ids[17][2] = 100
    path = write_parquet(tmp_path / "pq", make_table(ids), [6, 13])
    ds = open_dataset(path)
    ds.scan(vocab_size=None, max_len=None)
    with _one_line_error(r"row 17 \(part-002.parquet\): token id 100 outside \[0, 100\) for vocab size 100"):
        ds.scan(vocab_size=100, max_len=None)


def test_jsonl_type_errors(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    write_jsonl(path, [{"input_ids": [1, 2], "loss_mask": [1, 1]}, {"input_ids": [1, "x"], "loss_mask": [1, 1]}])
    with _one_line_error(r"row 1 \(m.jsonl\): input_ids has mixed or unsupported values"):
        open_dataset(path).scan(vocab_size=None, max_len=None)
    write_jsonl(path, [{"input_ids": [1, 2], "loss_mask": [1, 1]}, {"text": "x"}])
    with _one_line_error(r"row 1 \(m.jsonl\): input_ids is null"):
        open_dataset(path).scan(vocab_size=None, max_len=None)
    write_jsonl(path, [{"input_ids": [1.0, 2.0], "loss_mask": [1, 1]}])
    with _one_line_error(r"input_ids must be a list of integers.*double.*\(m.jsonl\)"):
        open_dataset(path).scan(vocab_size=None, max_len=None)


def test_large_scan_is_vectorised() -> None:
    n, width = 20_000, 64
    flat = RNG.integers(0, 1000, size=n * width).astype(np.int32)
    offsets = np.arange(0, n * width + 1, width, dtype=np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
    mask = pa.ListArray.from_arrays(pa.array(offsets), pa.array((flat % 2).astype(np.uint8)))
    ds = from_table(pa.table({"input_ids": ids, "loss_mask": mask}))
    scan = ds.scan(vocab_size=1000, max_len=50)
    assert scan.truncated == n and (scan.lengths == 50).all()
    assert int(scan.supervised.sum()) == int((flat.reshape(n, width)[:, :50] % 2).sum())
    rows = ds.read_rows(12_345, 12_350, max_len=50)
    np.testing.assert_array_equal(rows[0].input_ids, flat[12_345 * width : 12_345 * width + 50])


def test_empty_jsonl_says_no_rows(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    with _one_line_error(r"dataset empty.jsonl \(jsonl: 1 file\) has no rows"):
        open_dataset(tmp_path / "empty.jsonl")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with _one_line_error("blank.jsonl .* has no rows"):
        open_dataset(tmp_path / "blank.jsonl")


@pytest.mark.parametrize("other", ["rows.jsonl", "rows.arrow"])
def test_directory_of_mixed_formats_is_refused(tmp_path: Path, other: str) -> None:
    """Parquet beside JSONL (or Arrow) used to read the Parquet only, dropping the other rows silently."""
    d = write_parquet(tmp_path / "mixed", make_table(), [10])
    if other.endswith(".jsonl"):
        write_jsonl(d / other, jsonl_rows())
        shown = r"Parquet \(part-000.parquet, ...\) and JSONL \(rows.jsonl\)"
    else:
        with pa.OSFile(str(d / other), "wb") as sink, pa.ipc.new_stream(sink, make_table().schema) as writer:
            writer.write_table(make_table())
        shown = r"Arrow \(rows.arrow\) and Parquet \(part-000.parquet, ...\)"
    with _one_line_error(f"dataset directory .*mixed holds both {shown} files; keep one format per directory"):
        open_dataset(d)


def test_hf_directory_metadata_json_is_not_jsonl(tmp_path: Path) -> None:
    ds = open_dataset(write_hf(tmp_path / "ds", make_table(), [7]))
    assert ds.num_rows == len(IDS)


def _without_hanging(fn, seconds: float = 10.0):
    """fn()'s exception (or None), failing the test, rather than hanging it, if fn blocks."""
    import threading

    caught: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            caught.append(None)
        except BaseException as e:  # handed to the test
            caught.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert caught, f"still reading after {seconds} s: it blocks"
    return caught[0]


def test_fifos_and_devices_are_never_read(tmp_path: Path) -> None:
    """Reading a FIFO waits for a writer and /dev/zero never ends: refused by what they are, whether
    named directly, found in a data directory, or listed by a save_to_disk directory."""
    import os

    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a named pipe"), (Path("/dev/zero"), "a character device")):
        with _one_line_error(f"dataset path {path} is {kind}"):
            open_dataset(path)
    hf = write_hf(tmp_path / "hf", make_table(), [7])
    os.mkfifo(hf / "extra.arrow")
    err = _without_hanging(lambda: open_dataset(hf))
    assert isinstance(err, UserError) and str(err) == (f"dataset directory {hf} holds extra.arrow, which is a named "
                                                       "pipe (FIFO); move it out or write its rows to a regular file")
    (hf / "extra.arrow").unlink()
    state = json.loads((hf / "state.json").read_text())
    (hf / state["_data_files"][0]["filename"]).unlink()
    os.mkfifo(hf / state["_data_files"][0]["filename"])
    err = _without_hanging(lambda: open_dataset(hf))
    assert isinstance(err, UserError) and "which is a named pipe" in str(err)


@pytest.mark.parametrize("labels", [False, True])
def test_data_without_a_supervised_token_is_refused(labels: bool) -> None:
    """Nothing to learn: extraction would make a cache (and train --live a run) of no training signal."""
    unsupervised = [[0] * len(ids) for ids in IDS]
    with _one_line_error("no supervised token in any row " + (r"\(every label is -100\)" if labels else
                                                              r"\(every loss_mask is 0\)")):
        from_table(make_table(masks=unsupervised, labels=labels)).scan(vocab_size=None, max_len=None)
    late = from_table(pa.table({"input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 0, 1], [0, 1]]}))
    with _one_line_error(r"no supervised token in any row within --max-len .*with loss_mask 1$"):
        late.scan(vocab_size=None, max_len=1)  # supervised only past it
    assert late.scan(vocab_size=None, max_len=None).supervised.tolist() == [1, 1]
