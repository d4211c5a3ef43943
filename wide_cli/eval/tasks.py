"""Zero-shot multiple-choice tasks read from local JSONL, formatted as lm-evaluation-harness 0.4.

One explicit table (``TASKS``) lists each task: its local file, the harness task it mirrors, how a
record becomes a ``MCDoc`` (contexts, continuations, gold index), its metrics, and the metric that
enters the summary average. Prompts follow the harness yamls (``lm_eval/tasks/...``), with the
default ``target_delimiter`` " " between context and answer and no few-shot examples.

Summary metric per task (the same for dense and pruned rows, so their averages compare):
``acc_norm`` where the harness task defines it (arc_easy, arc_challenge, piqa, hellaswag,
openbookqa), else ``acc`` (boolq, winogrande). See ``SUMMARY_METRIC``.

Known difference from the harness: the staged HellaSwag file (shared/data PROVENANCE note 2) is
already preprocessed and keeps ``ctx_b`` uncapitalised, whereas the harness capitalises it; we
score ``query``/``endings`` as given, so HellaSwag numbers can differ slightly from the harness's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from wide_cli.errors import ConfigError, DataError

TARGET_DELIMITER = " "


@dataclass(frozen=True)
class MCDoc:
    """One multiple-choice item, ready to score.

    Attributes:
        contexts: one context per choice (identical for most tasks; winogrande varies it).
        continuations: one continuation per choice (delimiter included, e.g. ``" yes"``).
        choices: the harness's ``doc_to_choice`` strings; ``acc_norm`` divides each choice's
            log-likelihood by ``len(choice)`` (characters, exactly as the harness does).
        gold: index of the correct choice.
        line: 1-based line number in the source file.
    """

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    choices: tuple[str, ...]
    gold: int
    line: int = 0


class _Fields:
    """Field access that turns a missing/ill-typed field into DataError with file:line."""

    def __init__(self, rec: dict, where: str):
        self.rec, self.where = rec, where

    def get(self, path: str, typ=None):
        cur = self.rec
        for part in path.split("."):
            if not isinstance(cur, dict) or part not in cur:
                raise DataError(f"{self.where}: missing field {path!r}",
                                "each line must be one JSON record in the task's layout (see PROVENANCE.md)")
            cur = cur[part]
        if typ is not None and not isinstance(cur, typ):
            names = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
            raise DataError(f"{self.where}: field {path!r} is {type(cur).__name__}, expected {names}",
                            "check the file's layout against PROVENANCE.md")
        return cur

    def fail(self, msg: str):
        raise DataError(f"{self.where}: {msg}", "check the file's layout against PROVENANCE.md")


def _mc(context: str, choices: list[str], gold: int, f: _Fields) -> MCDoc:
    if not (0 <= gold < len(choices)):
        f.fail(f"gold index {gold} is outside the {len(choices)} choices")
    return MCDoc(
        contexts=tuple(context for _ in choices),
        continuations=tuple(TARGET_DELIMITER + c for c in choices),
        choices=tuple(choices),
        gold=gold,
    )


def _arc_like(f: _Fields, stem_path: str, prefix_template: str, strip_key: bool) -> MCDoc:
    stem = f.get(stem_path, str)
    raw = f.get("question.choices", list)
    texts, labels = [], []
    for i, c in enumerate(raw):
        if not isinstance(c, dict) or "text" not in c or "label" not in c:
            f.fail(f"question.choices[{i}] lacks 'text' or 'label'")
        texts.append(str(c["text"]))
        labels.append(str(c["label"]))
    key = f.get("answerKey", str)
    key = key.lstrip() if strip_key else key
    if key not in labels:
        f.fail(f"answerKey {key!r} is not one of the choice labels {labels}")
    return _mc(prefix_template.format(stem), texts, labels.index(key), f)


def build_arc(f: _Fields) -> MCDoc:
    """arc_easy / arc_challenge.yaml: ``Question: {question}\\nAnswer:``, choices = choice texts,
    gold = ``choices.label.index(answerKey)``."""
    return _arc_like(f, "question.stem", "Question: {}\nAnswer:", strip_key=False)


def build_openbookqa(f: _Fields) -> MCDoc:
    """openbookqa.yaml: context = ``question_stem`` alone, gold = index of ``answerKey.lstrip()``."""
    return _arc_like(f, "question.stem", "{}", strip_key=True)


def build_piqa(f: _Fields) -> MCDoc:
    """piqa.yaml: ``Question: {goal}\\nAnswer:``, choices ``[sol1, sol2]``, gold = ``label``."""
    label = f.get("label", int)
    return _mc(f"Question: {f.get('goal', str)}\nAnswer:", [f.get("sol1", str), f.get("sol2", str)], label, f)


def build_hellaswag(f: _Fields) -> MCDoc:
    """hellaswag.yaml after ``process_docs``: context = ``query``, choices = ``endings``, gold = ``label``
    (the staged file is already preprocessed; see the module docstring)."""
    endings = f.get("endings", list)
    if not all(isinstance(e, str) for e in endings):
        f.fail("field 'endings' must be a list of strings")
    label = f.get("label", (int, str))
    try:
        gold = int(label)
    except ValueError:
        f.fail(f"label {label!r} is not an integer")
    return _mc(f.get("query", str), list(endings), gold, f)


def build_boolq(f: _Fields) -> MCDoc:
    """super_glue/boolq/default.yaml: ``{passage}\\nQuestion: {question}?\\nAnswer:``, choices
    ``["no", "yes"]``; SuperGLUE's passage is ``title + " -- " + passage`` (PROVENANCE.md)."""
    passage = f"{f.get('title', str)} -- {f.get('passage', str)}"
    answer = f.get("answer", bool)
    return _mc(f"{passage}\nQuestion: {f.get('question', str)}?\nAnswer:", ["no", "yes"], int(answer), f)


def build_winogrande(f: _Fields) -> MCDoc:
    """winogrande/default.yaml (partial scoring): one context per option, ``sentence[:blank] + option``;
    the shared continuation is the text after the blank; gold = ``{"1": 0, "2": 1}[answer]``."""
    sentence = f.get("sentence", str)
    if "_" not in sentence:
        f.fail("field 'sentence' has no '_' blank")
    idx = sentence.index("_")
    answer = f.get("answer", str)
    if answer not in ("1", "2"):
        f.fail(f"answer {answer!r} must be \"1\" or \"2\"")
    contexts = [sentence[:idx] + f.get("option1", str), sentence[:idx] + f.get("option2", str)]
    cont = TARGET_DELIMITER + sentence[idx + 1:].strip()
    return MCDoc(contexts=tuple(contexts), continuations=(cont, cont), choices=tuple(contexts),
                 gold={"1": 0, "2": 1}[answer])


@dataclass(frozen=True)
class TaskSpec:
    """A zero-shot task.

    Attributes:
        name: our task name (= the harness task name).
        file: JSONL file under ``<data_dir>/zeroshot/``.
        split: which split the staged file holds.
        harness: the harness task (yaml) it mirrors.
        metrics: metric keys the harness task defines (``acc`` and maybe ``acc_norm``).
        summary_metric: the metric that enters the summary average.
        build: record -> ``MCDoc``.
    """

    name: str
    file: str
    split: str
    harness: str
    metrics: tuple[str, ...]
    summary_metric: str
    build: Callable[[_Fields], MCDoc]


_ACC_NORM = ("acc", "acc_norm")
TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        TaskSpec("arc_easy", "arc_easy.jsonl", "test", "arc/arc_easy.yaml", _ACC_NORM, "acc_norm", build_arc),
        TaskSpec("arc_challenge", "arc_challenge.jsonl", "test", "arc/arc_challenge.yaml", _ACC_NORM, "acc_norm",
                 build_arc),
        TaskSpec("piqa", "piqa.jsonl", "validation", "piqa/piqa.yaml", _ACC_NORM, "acc_norm", build_piqa),
        TaskSpec("hellaswag", "hellaswag.jsonl", "validation", "hellaswag/hellaswag.yaml", _ACC_NORM, "acc_norm",
                 build_hellaswag),
        TaskSpec("boolq", "boolq.jsonl", "validation", "super_glue/boolq/default.yaml", ("acc",), "acc",
                 build_boolq),
        TaskSpec("winogrande", "winogrande.jsonl", "validation (winogrande_xl dev)", "winogrande/default.yaml",
                 ("acc",), "acc", build_winogrande),
        TaskSpec("openbookqa", "openbookqa.jsonl", "test", "openbookqa/openbookqa.yaml", _ACC_NORM, "acc_norm",
                 build_openbookqa),
    )
}

#: The documented metric per task that enters the summary average.
SUMMARY_METRIC: dict[str, str] = {name: t.summary_metric for name, t in TASKS.items()}

#: Perplexity task names (handled by ``wide_cli.eval.wikitext`` / ``perplexity``).
PERPLEXITY_TASKS = ("wikitext",)


def get_task(name: str) -> TaskSpec:
    """The spec of a zero-shot task.

    Raises:
        ConfigError: an unknown name, listing the known tasks.
    """
    if name not in TASKS:
        known = ", ".join([*PERPLEXITY_TASKS, *TASKS])
        raise ConfigError(f"unknown task {name!r}", f"known tasks: {known}")
    return TASKS[name]


def check_limit(limit: int | None) -> None:
    """Raise ConfigError unless ``limit`` is None or >= 1."""
    if limit is not None and limit <= 0:
        raise ConfigError(f"limit {limit} must be >= 1", "omit --limit to use every item")


def task_path(task: TaskSpec, data_dir: Path) -> Path:
    p = Path(data_dir) / "zeroshot" / task.file
    if not p.is_file():
        raise DataError(f"task file {p} not found",
                        "pass --data-dir pointing at shared/data (it holds zeroshot/*.jsonl)")
    return p


def load_docs(name: str, data_dir: Path, limit: int | None = None) -> tuple[list[MCDoc], int]:
    """Read a task's JSONL: the first ``limit`` items (all when None), in file order.

    Returns:
        ``(docs, n_total)``: the items and the number of non-empty lines in the file (lines
        past the limit are counted, not parsed).

    Raises:
        ConfigError: unknown task, limit <= 0.
        DataError: missing file; a line that is not JSON or lacks a field (``file:line`` and the
            field are named); an empty file.
    """
    task = get_task(name)
    check_limit(limit)
    path = task_path(task, data_dir)
    docs: list[MCDoc] = []
    n_total = 0
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            n_total += 1
            if limit is not None and len(docs) >= limit:
                continue  # counted, not parsed: --limit reads only the first items
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})",
                                "each line must be one JSON object") from None
            if not isinstance(rec, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}",
                                "each line must be one JSON object")
            doc = task.build(_Fields(rec, where))
            docs.append(MCDoc(doc.contexts, doc.continuations, doc.choices, doc.gold, lineno))
    if not docs:
        raise DataError(f"task file {path} has no records", "check the file")
    return docs, n_total
