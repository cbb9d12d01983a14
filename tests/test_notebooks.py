"""The notebooks run top to bottom, with small settings, in a kernel of this very Python.

Each notebook reads its settings from `VITLAB_NB_*` environment variables in its `parameters` cell; the
test sets them (a 3-class subset, a few images per class, one epoch), runs the notebook with cwd
`notebooks/` and its runs in a temporary folder, and fails on the first cell that raises.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from vitlab import VisionTransformer, save_pretrained

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
NB_DIR = REPO / "notebooks"
NOTEBOOKS = ["01_quickstart.ipynb", "02_attention.ipynb", "03_what_vit_learns.ipynb"]
KERNEL = "vitlab-nbtest"
SMALL = {
    "VITLAB_NB_CLASSES": "cat,dog,ship",
    "VITLAB_NB_TRAIN_PER_CLASS": "8",
    "VITLAB_NB_VAL_PER_CLASS": "4",
    "VITLAB_NB_EPOCHS": "1",
    "VITLAB_NB_FT_EPOCHS": "1",
    "VITLAB_NB_IMAGES": "4",
}
# Files each notebook must leave in its runs folder when it trains its own model.
WRITES = {
    "01_quickstart.ipynb": ["quickstart/pretrain/checkpoints/last.ckpt", "quickstart/finetune/checkpoints/last.ckpt",
                            "quickstart/pretrain/csv/metrics.csv", "quickstart/finetune/csv/metrics.csv"],
    "02_attention.ipynb": ["attention/checkpoints/last.ckpt", "attention/grace_hopper_explain.png"],
    "03_what_vit_learns.ipynb": ["what_vit_learns/checkpoints/last.ckpt",
                                 "what_vit_learns/inspect/attention_distance.png"],
}  # fmt: skip
# Figures each notebook shows at the least, with the small settings.
MIN_FIGURES = {"01_quickstart.ipynb": 1, "02_attention.ipynb": 8, "03_what_vit_learns.ipynb": 9}


@pytest.fixture(scope="module")
def jupyter_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kernelspec for this interpreter (`sys.executable`), installed into a temporary prefix.

    Going through a spec of our own, not whatever `python3` resolves to on this machine, makes the
    notebooks run on the venv under test, on a fresh venv in CI as on a workstation.
    """
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("jupyter")
    install(kernel_name=KERNEL, display_name="vitlab (test)", prefix=str(prefix))
    return prefix / "share" / "jupyter"


@pytest.fixture
def kernel_env(jupyter_path: Path, cifar_subset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The kernel inherits this environment: small settings, the data, a temporary runs folder."""
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join([str(jupyter_path), os.environ.get("JUPYTER_PATH", "")]))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))  # no user profile or startup files
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "2"))
    monkeypatch.setenv("VITLAB_NB_DATA", str(cifar_subset))
    monkeypatch.setenv("VITLAB_NB_RUNS", str(tmp_path / "runs"))
    monkeypatch.delenv("VITLAB_NB_CKPT", raising=False)
    for key, value in SMALL.items():
        monkeypatch.setenv(key, value)
    return tmp_path / "runs"


def execute(name: str) -> nbformat.NotebookNode:
    """Run a notebook in `notebooks/`; a cell that raises fails the test (CellExecutionError)."""
    nb = nbformat.read(NB_DIR / name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.prefix)"))
    before = sorted(p.name for p in NB_DIR.iterdir())
    NotebookClient(nb, kernel_name=KERNEL, timeout=600, resources={"metadata": {"path": str(NB_DIR)}}).execute()
    assert sorted(p.name for p in NB_DIR.iterdir()) == before, "the notebook wrote into notebooks/"
    kernel_prefix = "".join(o.get("text", "") for o in nb.cells[-1].outputs).strip()
    assert Path(kernel_prefix).resolve() == Path(sys.prefix).resolve(), "the notebook ran on another Python"
    return nb


def figures(nb: nbformat.NotebookNode) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stored_clean(name):
    nb = nbformat.read(NB_DIR / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "parameters" in code[0].metadata.get("tags", []), "the first code cell must be tagged `parameters`"
    assert "VITLAB_NB_RUNS" in code[0].source and "VITLAB_NB_DATA" in code[0].source
    assert all(c.outputs == [] and c.execution_count is None for c in code), "outputs must be stripped"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_with_small_settings(name, kernel_env):
    nb = execute(name)
    for rel in WRITES[name]:
        assert (kernel_env / rel).is_file(), f"{name} did not write {rel}"
    assert figures(nb) >= MIN_FIGURES[name]


@pytest.mark.parametrize("name", ["02_attention.ipynb", "03_what_vit_learns.ipynb"])
def test_notebook_on_a_given_checkpoint(name, kernel_env, tmp_path, monkeypatch):
    # A `vitlab export` folder of another kind of model: conv stem, no class token, mean pooling.
    model = VisionTransformer(img_size=32, patch_size=8, num_classes=3, embed_dim=32, depth=2, num_heads=2,
                              stem="conv", stem_channels=16, class_token=False, pool="avg")  # fmt: skip
    model.data_config["class_names"] = ["cat", "dog", "ship"]
    monkeypatch.setenv("VITLAB_NB_CKPT", str(save_pretrained(model, tmp_path / "export")))
    nb = execute(name)
    assert not (kernel_env / "attention" / "checkpoints").exists()  # nothing trained
    assert not (kernel_env / "what_vit_learns" / "checkpoints").exists()
    assert figures(nb) >= 5
