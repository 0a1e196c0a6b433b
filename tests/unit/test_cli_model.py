"""`mesh-actor inspect` and `mesh-actor fit`: output, JSON keys, one-line errors and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.cli import main
from tests import tiny_models
from tests.tiny_pooled_models import write_llama_embedding
from tests.tiny_projectors import write_llava_projector

REQUIRED_KEYS = {
    "kv_bytes",
    "recurrent_bytes",
    "draft_kv_bytes",
    "weights_bytes",
    "compute_bytes",
    "host_extra_bytes",
    "total_bytes",
    "devices",
}


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_models.write_qwen35(tmp_path_factory.mktemp("m") / "qwen35.gguf"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_models.write_llama(tmp_path_factory.mktemp("m") / "llama.gguf"))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse reports usage errors by exiting
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_prints_the_layer_table(capsys: pytest.CaptureFixture[str], qwen35: str) -> None:
    code, out, err = run(capsys, "inspect", qwen35)
    assert code == 0 and err == ""
    assert "architecture  qwen35" in out
    assert "5 (1 nextn): 1 attention, 3 recurrent, 0 SWA" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [row[1] for row in rows] == ["recurrent", "recurrent", "recurrent", "attention", "-"]


def test_inspect_json_is_the_geometry(capsys: pytest.CaptureFixture[str], qwen35: str) -> None:
    code, out, _ = run(capsys, "inspect", qwen35, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["architecture"] == "qwen35"
    assert [layer["recurrent"] for layer in data["layers"]] == [True, True, True, False, False]
    assert data["layers"][4]["nextn"] is True


def test_fit_json_has_the_byte_counts_and_a_device_breakdown(capsys: pytest.CaptureFixture[str], qwen35: str) -> None:
    code, out, _ = run(
        capsys, "fit", qwen35, "--ctx", "4096", "-np", "2", "--spec-type", "draft-mtp", "--cache-ram", "0", "--json"
    )
    assert code == 0
    data = json.loads(out)
    assert data.keys() >= REQUIRED_KEYS
    assert all(isinstance(data[k], int) for k in REQUIRED_KEYS - {"devices"})
    assert data["draft_kv_bytes"] > 0 and data["recurrent_bytes"] > 0
    assert data["total_bytes"] == sum(d["total_bytes"] for d in data["devices"])
    assert "fits" not in data or data["fits"] is None


def test_fit_with_memory_reports_fits_and_the_context_ceiling(capsys: pytest.CaptureFixture[str], llama: str) -> None:
    code, out, _ = run(capsys, "fit", llama, "-c", "4096", "-ngl", "0", "--memory", "512MiB", "-cram", "0", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["fits"] is True
    assert data["max_context"] >= 4096
    assert data["devices"][0]["budget_bytes"] == 512 << 20


def test_fit_table_names_devices_and_exact_figures(capsys: pytest.CaptureFixture[str], llama: str) -> None:
    code, out, _ = run(capsys, "fit", llama, "-c", "2048", "--memory", "1GiB,512MiB")
    assert code == 0
    assert "GPU0" in out and "GPU1" in out and "CPU" in out
    assert "exact: KV" in out and "largest context that fits" in out


def test_fit_defaults_to_four_unified_slots_like_llama_server(capsys: pytest.CaptureFixture[str], llama: str) -> None:
    _, out, _ = run(capsys, "fit", llama, "-c", "4096", "--json")
    context = json.loads(out)["context"]
    assert (context["n_seq_max"], context["n_stream"]) == (4, 1)


@pytest.mark.parametrize(
    "argv",
    [
        ["fit", "MODEL", "--ctx", "abc"],
        ["fit", "MODEL", "--parallel", "0"],
        ["fit", "MODEL", "--cache-type-k", "q3_k"],
        ["fit", "MODEL", "--flash-attn", "maybe"],
        ["fit", "MODEL", "--memory", "24GB,lots"],
        ["fit", "MODEL", "--memory", "-1G"],
        ["fit", "MODEL", "--spec-type", "telepathy"],
        ["fit", "MODEL", "-ngl", "0", "--memory", "1G,2G"],
        ["fit", "MODEL", "-fa", "off", "-ctv", "q8_0"],
        ["fit", "MODEL", "-ngl", "-5"],
    ],
)
def test_bad_flags_are_one_line_usage_errors(capsys: pytest.CaptureFixture[str], llama: str, argv: list[str]) -> None:
    code, out, err = run(capsys, *[llama if a == "MODEL" else a for a in argv])
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and "error" in err


def test_unreadable_model_is_a_model_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "fit", str(tmp_path / "missing.gguf"))
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and "cannot read" in err


def test_hostile_model_is_a_model_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1 << 62).to_bytes(8, "little") + bytes(8))
    for command in ("inspect", "fit"):
        code, _, err = run(capsys, command, str(path))
        assert code == 1
        assert len(err.strip().splitlines()) == 1


def test_unsupported_architecture_is_refused_by_name(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = tiny_models.ModelSpec(arch="bert", kv={"bert.block_count": 1})
    spec.add("token_embd.weight", (8, 8))
    path = tiny_models.write_model(spec, tmp_path / "bert.gguf")
    code, _, err = run(capsys, "inspect", str(path))
    assert code == 1
    assert "unsupported architecture 'bert'" in err


def test_settings_the_model_cannot_serve_are_a_model_error(capsys: pytest.CaptureFixture[str], llama: str) -> None:
    code, _, err = run(capsys, "fit", llama, "--spec-type", "draft-mtp")
    assert code == 1
    assert "nextn" in err


def test_fit_sizes_an_embedding_model_as_placement_does(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = str(write_llama_embedding(tmp_path / "embed.gguf"))
    base = ("fit", model, "--ctx", "4096", "-np", "2", "--cache-ram", "0", "--json")
    code, out, _ = run(capsys, *base)  # the header's mean pooling: an embedding server
    assert code == 0
    embedding = json.loads(out)
    assert embedding["context"]["n_ubatch"] == 2048  # a whole input: the per-slot context
    assert embedding["output_bytes"] == 4 * (259 + 64) * 2 and embedding["host_extra_bytes"] > 0
    code, out, _ = run(capsys, *base, "--kind", "generate")
    assert code == 0
    generate = json.loads(out)
    assert generate["context"]["n_ubatch"] == 512 and generate["output_bytes"] == 4 * 259 * 2
    code, _, err = run(capsys, *base, "--kind", "rerank")  # no classification head
    assert code != 0 and "classification head" in err


def test_fit_sizes_a_projector_beside_the_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = str(tiny_models.write_llama(tmp_path / "m.gguf"))
    mmproj = str(write_llava_projector(tmp_path / "p.gguf", text_embd=64))
    code, out, _ = run(capsys, "fit", model, "-c", "4096", "-cram", "0", "--mmproj", mmproj, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["projector_weights_bytes"] > 0 and data["projector_compute_bytes"] > 0
    code, out, _ = run(capsys, "fit", model, "-c", "4096", "-cram", "0", "--mmproj", mmproj)
    assert code == 0 and "projector (CPU): weights" in out
    code, _, err = run(capsys, "fit", model, "--mmproj", model)  # a model is not a projector
    assert code != 0 and "architecture is 'clip'" in err
