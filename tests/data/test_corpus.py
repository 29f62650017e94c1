"""Reading .txt/.jsonl files and directories, and the errors for bad data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from potluck.data import builtin_corpus_path, data_files, read_documents
from potluck.errors import ConfigError


def test_directory_is_read_recursively_in_sorted_order(tmp_path: Path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"text": "first", "id": 1}) + "\n\n" + json.dumps({"text": "also first"}) + "\n"
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third")
    (tmp_path / "notes.md").write_text("ignored")
    assert read_documents(tmp_path) == ["first", "also first", "second", "third"]


def test_empty_documents_are_dropped(tmp_path: Path):
    (tmp_path / "a.txt").write_text("  \n")
    (tmp_path / "b.txt").write_text("kept")
    assert read_documents(tmp_path) == ["kept"]


def test_missing_path_is_one_line(tmp_path: Path):
    with pytest.raises(ConfigError, match="not found") as err:
        read_documents(tmp_path / "missing.txt")
    assert "\n" not in str(err.value)


def test_only_empty_text_is_an_error(tmp_path: Path):
    (tmp_path / "a.txt").write_text("")
    with pytest.raises(ConfigError, match="no text"):
        read_documents(tmp_path)


def test_directory_without_data_files_is_an_error(tmp_path: Path):
    (tmp_path / "readme.md").write_text("hello")
    with pytest.raises(ConfigError, match="no .txt or .jsonl"):
        read_documents(tmp_path)


def test_unknown_file_type_is_an_error(tmp_path: Path):
    path = tmp_path / "data.csv"
    path.write_text("a,b")
    with pytest.raises(ConfigError, match="expected a .txt or .jsonl"):
        read_documents(path)


def test_jsonl_line_without_text_names_file_and_line(tmp_path: Path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no"}) + "\n")
    with pytest.raises(ConfigError, match=r"d.jsonl:2: .*'text'"):
        read_documents(path)


def test_malformed_jsonl_names_file_and_line(tmp_path: Path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ConfigError, match=r"d.jsonl:2: malformed JSON"):
        read_documents(path)


def test_builtin_corpus_ships_with_the_package_and_is_small_english_text():
    files = data_files(builtin_corpus_path())
    assert len(files) >= 2
    assert all(f.suffix == ".txt" for f in files)
    total_bytes = sum(f.stat().st_size for f in files)
    assert 50_000 < total_bytes < 400_000
    text = " ".join(read_documents(builtin_corpus_path()))
    assert text.isascii() and " the " in text


def test_a_data_file_too_large_to_read_whole_is_one_line(tmp_path: Path):
    from potluck.data.corpus import MAX_DATA_FILE_BYTES

    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as file:
        file.truncate(MAX_DATA_FILE_BYTES + 1)  # sparse: no disk used, and never read
    with pytest.raises(ConfigError, match="huge.txt: the data file is larger than 4,294,967,296"):
        read_documents(tmp_path)
