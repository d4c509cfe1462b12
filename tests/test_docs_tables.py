"""Every result table in the docs is what its committed results files render (`flows.docs_tables`), and a table
edited by hand is caught."""

import shutil

import pytest

from conftest import REPO
from flows.docs_tables import differing, files, render

RESULTS = [f"benchmarks/results/positive-control-0b2991a-s{k}-look-results.json" for k in range(3)]


def test_every_table_in_the_docs_is_what_its_data_renders():
    blocks = sum(path.read_text().count("<!-- table: ") for path in files(REPO))
    assert blocks >= 9  # the method tables of docs/ (qevolve, step-hrl, multi2, terminaltraj)
    assert differing(REPO) == []


def _copy(tmp_path) -> str:
    for rel in ["benchmarks/positive-control.yaml", *RESULTS]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tmp_path / rel)
    return "benchmarks/positive-control.yaml " + " ".join(RESULTS)


def test_a_table_edited_by_hand_fails_the_check_and_is_written_again(tmp_path):
    args = _copy(tmp_path) + " | columns: seen success %, Δ seen"
    table = render(args, tmp_path)
    assert table.splitlines()[0] == "| # | row | seeds | seen success % | Δ seen |"
    # BPPO's row of the positive control, as docs/qevolve.md quotes it (11 of 144 seen games, 3 seeds)
    assert "| 3 | Q-Evolve's update on the look mix | 3 | 7.6 [3.9, 14.5] (11/144) | +7.6 [+1.4, +16.0]" in table
    doc = tmp_path / "docs" / "page.md"
    doc.parent.mkdir()
    good = f"# A page\n\nText.\n\n<!-- table: {args} -->\n{table}<!-- end table -->\n"
    doc.write_text(good)
    assert differing(tmp_path) == []
    doc.write_text(good.replace("7.6 [3.9, 14.5] (11/144)", "9.0 [3.9, 14.5] (11/144)"))
    assert differing(tmp_path) == ["docs/page.md:5"]
    assert differing(tmp_path, write=True) == ["docs/page.md:5"]
    assert doc.read_text() == good and differing(tmp_path) == []


def test_rows_and_columns_are_chosen_by_name_and_a_wrong_name_is_an_error(tmp_path):
    args = _copy(tmp_path)
    two = render(args + " | rows: 1, 3 | columns: seen success %", tmp_path).splitlines()
    assert [line.split("|")[1].strip() for line in two[2:]] == ["1", "3"]
    with pytest.raises(ValueError, match=r"no column\(s\) \['seen won'\]"):
        render(args + " | columns: seen won", tmp_path)
