"""The environment registry: TextCraft eager, ALFWorld/WebShop lazy (no heavy import at package import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import environments
from environments import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_environments_and_textcraft_games_import_no_heavy_package():
    # TextCraft reads the textcraft package's recipe files without importing it (it imports gymnasium)
    code = (
        "import sys, json, environments\n"
        "environments.make('textcraft').reset(0, 0)\n"
        "print(json.dumps([environments.registered(), "
        "sorted(m for m in sys.modules if m.split('.')[0] in "
        "('alfworld', 'textworld', 'web_agent_site', 'textcraft', 'gymnasium') "
        "or m in ('environments.alfworld', 'environments.webshop'))]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    names, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"textcraft", "alfworld", "webshop"} <= set(names)
    assert heavy == []


def test_lazy_names_import_their_module_on_make(monkeypatch):
    monkeypatch.setitem(registry._LAZY, "_missing_game", "environments._no_such_module")
    with pytest.raises(
        ValueError, match="'_missing_game' is not available: module environments._no_such_module is missing"
    ):
        environments.make("_missing_game")
    monkeypatch.setitem(registry._LAZY, "_silent_game", "environments.testing")
    with pytest.raises(ValueError, match="module environments.testing did not register environment '_silent_game'"):
        environments.make("_silent_game")
    with pytest.raises(ValueError, match=r"unknown environment 'chess'; known: \[.*'textcraft'"):
        environments.make("chess")


def test_register_refuses_a_duplicate_name():
    spec = environments.game_spec("textcraft")
    with pytest.raises(ValueError, match="'textcraft' is already registered"):
        registry.register_game(registry.GameSpec("textcraft", spec.factory, spec.template, "look"))
