"""Text-format splits cut from local text files (real text for held-out LM loss, e.g. Evidence III).

Every file goes whole into one split, picked by a hash of its name (not of the seed), so a document's
windows are never in two splits and adding files never moves an old one; within a file, paragraphs are
packed greedily into windows of at most `window_chars` characters (a longer paragraph is cut at line
breaks, then at the limit). Records are `{"text", "source"}` (format text: the LM loss learns every token).

Default source: the release notes Debian's `git` package ships (`/usr/share/doc/git/RelNotes`, 485 files,
3 MB of English prose nobody here wrote). They are public on GitHub, so a pretrained model may have read
them: "held out" here means held out from distillation, not unseen in pretraining.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

GIT_RELNOTES = Path("/usr/share/doc/git/RelNotes")
SPLITS = ("train", "dev", "test")


def split_of(name: str, dev_share: float, test_share: float) -> str:
    """The split of a file named `name`: a fixed hash of the name into [0, 1), test first, then dev."""
    u = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64
    return "test" if u < test_share else "dev" if u < test_share + dev_share else "train"


def windows(text: str, window_chars: int) -> list[str]:
    """`text` packed into windows of at most `window_chars` characters at paragraph, then line, breaks."""
    pieces: list[str] = []
    for para in (p.strip() for p in text.split("\n\n")):
        while len(para) > window_chars:  # cut at the last line break inside the limit, else at the limit
            cut = para.rfind("\n", 0, window_chars)
            cut = cut if cut > 0 else window_chars
            pieces.append(para[:cut].rstrip())
            para = para[cut:].lstrip()
        if para:
            pieces.append(para)
    out, cur = [], ""
    for p in pieces:
        if cur and len(cur) + 2 + len(p) > window_chars:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{p}" if cur else p
    return [*out, cur] if cur else out


def make_splits(source: str | Path, *, n_train: int, n_dev: int, n_test: int, window_chars: int = 1000,
                dev_share: float = 0.1, test_share: float = 0.1, seed: int = 0) -> dict[str, list[dict]]:
    """`{train, dev, test}` text records from the `*.txt` files under `source` (a directory, or one file);
    each split is its files' windows in a seeded order, the first `n_<split>` of them.

    ValueError (one line) when `source` has no text, or a split has fewer windows than asked for.
    """
    root = Path(source)
    files = sorted(root.rglob("*.txt")) if root.is_dir() else [root] if root.is_file() else []
    if not files:
        raise ValueError(f"--source {source}: no .txt files there; pass a directory of text files (Debian's git "
                         f"package ships {GIT_RELNOTES})")
    found: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for f in files:
        name = str(f.relative_to(root)) if root.is_dir() else f.name
        text = f.read_text(encoding="utf-8", errors="replace")
        found[split_of(name, dev_share, test_share)] += [{"text": w, "source": name} for w in windows(text, window_chars)]
    out = {}
    for i, (split, n) in enumerate(zip(SPLITS, (n_train, n_dev, n_test))):
        recs = found[split]
        random.Random(seed * 1_000_003 + i).shuffle(recs)
        if len(recs) < n:
            raise ValueError(f"{source} gives {len(recs)} {split} windows of <= {window_chars} characters, fewer than "
                             f"the {n} asked; ask for fewer (--n_{split}) or shorter windows (--window_chars)")
        out[split] = recs[:n]
    return out
