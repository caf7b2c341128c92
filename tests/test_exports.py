"""Tests for the public surface of the epochcache package."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import epochcache


def test_all_is_sorted_and_unique() -> None:
    assert epochcache.__all__ == sorted(epochcache.__all__)
    assert len(set(epochcache.__all__)) == len(epochcache.__all__)


def test_every_exported_name_resolves() -> None:
    for name in epochcache.__all__:
        assert getattr(epochcache, name) is not None, name


def test_lazy_names_are_exported() -> None:
    for name in ("EpochCachedLoader", "EpochInfo", "ShardSetDataset"):
        assert name in epochcache.__all__
        assert getattr(epochcache, name).__name__ == name


def test_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        epochcache.no_such_name  # noqa: B018


def test_errors_form_one_tree() -> None:
    assert issubclass(epochcache.ConfigError, epochcache.EpochcacheError)
    assert issubclass(epochcache.SourceError, epochcache.EpochcacheError)
    assert issubclass(epochcache.BudgetError, epochcache.CacheError)
    assert issubclass(epochcache.DaemonRunningError, epochcache.CacheError)
    assert issubclass(epochcache.ShardCorruptError, epochcache.CacheError)
    assert issubclass(epochcache.CacheEmptyError, epochcache.LoaderError)
    assert issubclass(epochcache.LoaderError, epochcache.EpochcacheError)


def test_import_does_not_import_torch() -> None:
    code = "import sys, epochcache; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False", result.stderr


def test_cli_import_does_not_import_torch() -> None:
    code = "import sys, epochcache.cli, epochcache.sync.daemon, epochcache.tools.status; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False", result.stderr



@pytest.mark.slow  # (a fresh process: 4 s)
def test_trainer_import_does_not_import_the_remote_formats() -> None:
    code = ("import sys, epochcache.train.loader; "
            "print(sorted(m for m in ('s3fs', 'fsspec', 'epochcache.sync.daemon') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stderr

README = Path(__file__).parents[1] / "README.md"


def test_readme_layout_names_every_module() -> None:
    layout = README.read_text(encoding="utf-8").split("## Layout", 1)[1]
    package = Path(epochcache.__file__).parent
    missing = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                     if f"`{path.name}`" not in layout and path.name != "__init__.py")
    assert missing == [], f"README.md's Layout does not name {missing}"


def test_readme_links_stay_in_the_repository() -> None:
    text = README.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)]+)\)", text):
        assert "://" not in target and not target.startswith(".."), target
        assert (README.parent / target.split("#")[0]).exists(), target
    assert "shared/" not in text
