import runpy
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_configuration_doc_matches_the_settings():
    render = runpy.run_path(str(DOCS / "configuration.py"))["render"]
    assert (DOCS / "configuration.md").read_text() == render(), "run: .venv/bin/python docs/configuration.py"
