"""Model cards of saved students: a `README.md` beside the weights (huggingface_hub `ModelCard`).

The card's YAML metadata holds everything its text shows, under `kvdistill:` — base model, teachers
with their config hashes, the recipe (signals, weights, alignment, layer maps), data, steps and
evaluations — so `kvdistill eval --update_card` can add a result and re-render the card from the card
alone. The Hub's `model-index` (`eval_results`) is derived from the evaluations.

Example:
    >>> write_card("runs/student", cfg.to_yaml_dict(), teacher_set.manifest(), card_sections(), step=1000)
    >>> record_evaluation("runs/student", result)  # `kvdistill eval --update_card` does this with its result
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from kvdistill.config import teacher_controls
from kvdistill.io import write_text_atomic
from kvdistill.report import fmt_num, fmt_sig, markdown_table

CARD_FILE = "README.md"
# the card's option sections; which options each shows is declared on the options (`card=` in
# train/config.py) and handed to `card_info`
SECTIONS = ("signals", "alignment", "data", "training")
EVAL_KEYS = ("data", "split", "n", "n_correct", "accuracy", "ci_low", "ci_high", "perplexity", "max_new_tokens",
             "chat_template")

TEMPLATE = """---
{{ card_data }}
---

# {{ name }}

A causal LM student {% if n_teachers -%}
distilled with kvdistill from the key/value caches of {{ n_teachers }} teacher(s)
{%- else -%}
trained with kvdistill on its labels only (no teacher)
{%- endif %}, saved at optimizer step {{ step }}.
{% if control and control != "none" %}
**Control run** (`teacher_control: {{ control }}`): trained against a control target, not a teacher's
knowledge; it is the yardstick a distilled student must beat (docs/evaluation.md), not a student to use.

{% elif control_teachers %}
**Control teachers** ({{ control_teachers }}): their signal is a control target, not a teacher's knowledge;
the run is a yardstick a distilled student must beat (docs/evaluation.md), not a student to use.

{% endif %}It is a plain `transformers` model: `aligners/` and `kvdistill_modules.safetensors` serve only to
resume training.

- **Base model** (the student's initialisation): `{{ base_model }}`
- **Steps**: {{ step }} of {{ max_steps }}

## Teachers

{{ teachers_table }}
## Distillation recipe

Loss = Σ weight × signal (the KV weight ramps up linearly over the warm-up steps).

{{ signals_table }}
{{ alignment_table }}
**Layer maps** (student layer ← teacher layers, weight):

{{ layer_maps_table }}
## Data

{{ data_table }}
## Training

{{ training_table }}
## Evaluation

{{ evaluation }}

## Use

```python
from transformers import pipeline

generator = pipeline("text-generation", model="path/to/this/directory")
prompt = {{ prompt_template | tojson }}.format(question="Tom has 3 apples and buys 2 more. How many does he have?")
print(generator(prompt, max_new_tokens=256, do_sample=False)[0]["generated_text"])
```
"""


def card_info(
    config: Mapping[str, Any],
    teachers: Sequence[Mapping[str, Any]],
    sections: Mapping[str, Sequence[str]],
    *,
    step: int | None = None,
    layer_maps: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The `kvdistill:` metadata of a student's card, from plain data.

    Args:
        config: the run's options (`KVDistillConfig.to_yaml_dict()`).
        teachers: the teacher manifest, `[{name, path, config_hash, weight}]` (a control teacher's entry gets
            its `control`).
        sections: `{section of SECTIONS: option names it shows}` (`train.config.card_sections()`).
        step: optimizer step of the saved weights.
        layer_maps: `{teacher: M [L_s, L_t]}` (tensor, array or nested lists).

    Returns:
        `{name, base_model, step, teachers, signals, alignment, layer_maps, data, training, evaluations}`;
        each layer map as, per student layer, `{teacher layer: weight}` of its non-zero weights.
    """
    def pick(section: str) -> dict[str, Any]:
        return {k: config[k] for k in sections.get(section, ()) if k in config}

    run_control = config.get("teacher_control", "none")
    controls = teacher_controls(config.get("teachers"), run_control)  # a control teacher's entry names its control
    entries = []
    for t in teachers:
        entry = {k: t.get(k) for k in ("name", "path", "config_hash", "weight")}
        control = controls.get(t.get("name"), run_control)
        entries.append(entry if control == "none" else {**entry, "control": control})
    maps = {}
    for name, matrix in (layer_maps or {}).items():
        rows = matrix.tolist() if hasattr(matrix, "tolist") else matrix  # [L_s][L_t]
        maps[name] = [{t: round(float(w), 4) for t, w in enumerate(row) if w > 0} for row in rows]
    return {
        "name": Path(str(config.get("output_dir") or "student")).name,
        "base_model": config.get("student"),
        "step": step,
        "teachers": entries,
        "signals": pick("signals"),
        "alignment": pick("alignment"),
        "layer_maps": maps,
        "data": pick("data"),
        "training": pick("training"),
        "evaluations": [],
        "control": run_control,  # a control run says so on its card
    }


def render_card(info: Mapping[str, Any]) -> ModelCard:
    """The card of `info` (`card_info`'s dict): metadata, model-index and text."""
    evaluations = info.get("evaluations") or []
    data = ModelCardData(
        base_model=info.get("base_model"),
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["kvdistill", "knowledge-distillation", "kv-cache-distillation"],
        model_name=info["name"],
        eval_results=[
            EvalResult(task_type="text-generation", dataset_type=e["data"], dataset_name=e["data"],
                       dataset_split=e["split"], metric_type="accuracy", metric_value=e["accuracy"],
                       metric_name=f"accuracy (n={e['n']})")
            for e in evaluations
        ] or None,
        kvdistill=dict(info),
    )
    return ModelCard.from_template(
        data,
        template_str=TEMPLATE,
        name=info["name"],
        step=info.get("step"),
        max_steps=info.get("training", {}).get("max_steps"),
        n_teachers=len(info.get("teachers", [])),
        prompt_template=info.get("data", {}).get("prompt_template", "Question: {question}\nAnswer:"),
        control=info.get("control"),
        control_teachers=", ".join(f"`{t['name']}: {t['control']}`" for t in info.get("teachers", [])
                                   if t.get("control", "none") != "none"),
        teachers_table=_teachers_table(info.get("teachers", [])),
        signals_table=_signals_table(info.get("signals", {})),
        alignment_table=_options_table(info.get("alignment", {})),
        layer_maps_table=_layer_maps_table(info.get("layer_maps", {})),
        data_table=_options_table(info.get("data", {})),
        training_table=_options_table(info.get("training", {})),
        evaluation=_evaluation_table(evaluations) if evaluations else
        "Not evaluated yet: `kvdistill eval --model <this directory> --data <test set>` adds its results here.",
    )


def write_card(
    model_dir: str | Path,
    config: Mapping[str, Any],
    teachers: Sequence[Mapping[str, Any]],
    sections: Mapping[str, Sequence[str]],
    *,
    step: int | None = None,
    layer_maps: Mapping[str, Any] | None = None,
) -> Path:
    """Write `model_dir/README.md` for a saved student (arguments as `card_info`); returns its path.

    A new save starts with no evaluation: results of other weights must not carry over.
    """
    info = card_info(config, teachers, sections, step=step, layer_maps=layer_maps)
    return write_text_atomic(Path(model_dir) / CARD_FILE, str(render_card(info)))


def read_card_info(model_dir: str | Path) -> dict[str, Any] | None:
    """The `kvdistill:` metadata of `model_dir`'s card; None when it has no card written by kvdistill."""
    path = Path(model_dir) / CARD_FILE
    if not path.is_file():
        return None
    info = ModelCard.load(path).data.to_dict().get("kvdistill")
    return info if isinstance(info, dict) else None


def record_evaluation(model_dir: str | Path, result: Mapping[str, Any]) -> Path | None:
    """Add an evaluation (`run_eval`'s result) to the card of `model_dir` and re-render it.

    An earlier result on the same data, split and number of items is replaced. Returns the card's
    path, or None when `model_dir` holds no kvdistill card (a Hub id or another model is left alone).
    """
    info = read_card_info(model_dir)
    if info is None:
        return None
    entry = {k: result.get(k) for k in EVAL_KEYS}
    key = ("data", "split", "n")
    kept = [e for e in info.get("evaluations", []) if [e.get(k) for k in key] != [entry[k] for k in key]]
    info["evaluations"] = [*kept, entry]
    return write_text_atomic(Path(model_dir) / CARD_FILE, str(render_card(info)))


# ----------------------------------------------------------------------------- tables


def _teachers_table(teachers: Sequence[Mapping[str, Any]]) -> str:
    if not teachers:
        return "None: the student learned from the labels only.\n"
    return markdown_table(["teacher", "model", "fusion weight", "config hash", "control"],
                          [[t["name"], f"`{t['path']}`", t["weight"], f"`{t['config_hash']}`",
                            t.get("control", "none")] for t in teachers])


def _signals_table(s: Mapping[str, Any]) -> str:
    rows = [
        ["cross-entropy on the labels", s.get("ce_weight"), ""],
        [f"KV ({s.get('kv_loss')})", s.get("kv_weight"), f"warm-up {s.get('kv_warmup_steps')} steps"],
        ["CODI hidden state", s.get("codi_weight"), ""],
        [f"logit KD ({s.get('logit_kd_kind')})", s.get("logit_kd_weight"),
         f"temperature {s.get('logit_kd_temperature')}"],
    ]
    return markdown_table(["signal", "weight", "setting"], rows)


def _options_table(options: Mapping[str, Any]) -> str:
    def value(v: Any) -> str:  # strings as code, escaped where a newline would break the table
        if isinstance(v, str):
            return f"`{v}`" if v.isprintable() else f"`{v!r}`"
        return fmt_sig(v) if v is None or isinstance(v, (bool, int, float)) else str(v)

    return markdown_table(["option", "value"], [[k, value(v)] for k, v in options.items()])


def _layer_maps_table(maps: Mapping[str, list]) -> str:
    if not maps:
        return "None (no teacher).\n"
    def cell(rows: list, s: int) -> str:
        return ", ".join(f"{t} ({fmt_num(w, 2)})" for t, w in rows[s].items()) if s < len(rows) else ""

    n_layers = max(len(rows) for rows in maps.values())
    return markdown_table(["student layer", *maps], [[s, *(cell(rows, s) for rows in maps.values())]
                                                     for s in range(n_layers)])


def _evaluation_table(evaluations: Sequence[Mapping[str, Any]]) -> str:
    """Accuracy with its Wilson 95 % interval, as `kvdistill eval` measured it (greedy, exact match)."""
    rows = [[e["data"], e["split"], e["n"], fmt_num(e["accuracy"]),
             f"[{fmt_num(e['ci_low'])}, {fmt_num(e['ci_high'])}]", fmt_sig(e.get("perplexity")),
             e.get("max_new_tokens")] for e in evaluations]
    return markdown_table(["data", "split", "items", "accuracy", "95 % CI", "perplexity", "max new tokens"], rows)
