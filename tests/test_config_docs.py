from pathlib import Path

from relaytrain.config.docs import render


def test_config_reference_is_current():
    page = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    assert page == render(), "regenerate: python -m relaytrain.config.docs > docs/config.md"
