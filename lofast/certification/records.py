"""Per-sample records and their files (JSONL): the record, its schema, the writer that appends
and resumes, the reader that checks every value, and the merge of a run's shards.

Schema 4 (written now): a header line ``{"schema": 4, "eps": [keys], "run": {settings}}``;
for every session of the run (a ``lofast certify`` that certified some of its samples: the
first, then each resume) a line ``{"session": {"device": text, "proof_seconds": s}}``, written
once its once-per-model proofs are made, so that a saved run says where it ran and how long its
proofs took; one record a line, each without the run settings and with its ``certified_radius``
(the largest radius any verifier certified); and a line ``{"finished": {"samples": N}}`` when a
run over N samples has a record for every one of them. A resumed run appends its session, its
records and, once it finishes, its own such line: the file's run is finished where its last
line is one. Schema 3 is schema 4 without session lines, schema 2 schema 3 without finished
lines; schema 1 has no header either, every record carrying its ``run`` (earlier files, read
and resumed in their own schema: 1 and 2 do not say whether their run finished, 1 to 3 not
where it ran). Eps keys are ``eps_key`` texts, in files alone.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from lofast.errors import LofastError
from lofast.files import atomic_write, check_readable, read_lines

SCHEMA = 4  # the record schema this lofast writes
READ_SCHEMAS = (1, 2, 3, 4)  # the schemas it reads and resumes (1 has no header line)


def eps_key(eps: float) -> str:
    """The text form of an eps value used as a JSON key: the shortest decimal that reads back
    as the same float, so two distinct eps never share a key (36/255 is 0.1411764705882353)."""
    return repr(float(eps))


@dataclass(frozen=True)
class EpsResult:
    """One sample's certificate at one eps. Frozen: a fallback verifier's or an attack's
    finding makes a new result (``SampleRecord.update``), never an edit of LoFAST's.

    certified: by any verifier; verifier: which ("lofast", "crown", "alpha-crown",
    "beta-crown"; None where not certified); bound: LoFAST's bound on the pooled features'
    change (None where it overflowed); reason: why not certified, when known; fallback: where a
    fallback verifier ran, {"method", "verdict" ("verified" / "unknown" / "falsified"), "bound"
    (its lower bound on the smallest margin, or None), "domains" (subdomains bounded by branch
    and bound, or None), "seconds"}, and fallback_seconds its time; falsified: with --attack,
    whether a counterexample within eps was found (None: no attack ran; never where
    certified); counterexample: the found one's {"norm", "class", "file"}."""

    certified: bool
    verifier: str | None = None
    bound: float | None = None
    reason: str | None = None
    fallback: dict[str, Any] | None = None
    fallback_seconds: float | None = None
    falsified: bool | None = None
    counterexample: dict[str, Any] | None = None

    @property
    def verdict(self) -> str:
        """"certified", "falsified" or "unknown" (VNN-COMP's three verdicts)."""
        if self.certified:
            return "certified"
        return "falsified" if self.falsified else "unknown"


@dataclass
class SampleRecord:
    """One certified sample; results: its certificate at each eps (float), in the run's order.
    Eps values become ``eps_key`` texts only in files (``to_json``, ``record_from_json``)."""

    index: int
    label: int
    prediction: int
    margin: float  # min_j z_y - z_j (negative when misclassified)
    radius: float  # largest radius LoFAST certifies (0 when misclassified)
    results: dict[float, EpsResult]
    rule: str = "pairwise-head"  # z_y - z_j > ||w_y - w_j|| delta_h for all j
    seconds: float = 0.0  # time spent on this sample (its share of the batch, all stages)
    # What the verdicts depend on (checkpoint and data digests, bound, guarantee, fallback):
    # a resumed run must match it, so that one file never mixes two runs' certificates.
    run: dict[str, Any] = field(default_factory=dict)
    # With --attack: the smallest l2 distance at which an attack changed the prediction (0 when
    # misclassified; None where none was found, or no attack ran). radius / adversarial_radius
    # says how much of the robustness the attack cannot break the certificate shows.
    adversarial_radius: float | None = None

    @property
    def eps(self) -> tuple[float, ...]:
        return tuple(self.results)

    def update(self, eps: float, **changes: Any) -> None:
        """Replace the result at eps by one with ``changes`` (``EpsResult`` fields)."""
        self.results[eps] = dataclasses.replace(self.results[eps], **changes)

    @property
    def certified_radius(self) -> float:
        """The largest radius certified by any verifier: LoFAST's radius, or a larger eps a
        fallback verifier certified."""
        return max([self.radius] + [e for e, result in self.results.items() if result.certified])

    @property
    def attacked(self) -> bool:
        """Whether an attack ran on this sample (--attack)."""
        return any(result.falsified is not None for result in self.results.values())

    def to_json(self, schema: int = SCHEMA) -> str:
        """The record's line: the per-eps results as dicts keyed by ``eps_key`` (only the
        entries that exist: reasons where known, fallbacks where one ran, ...); in schemas 2
        and 3 without the run settings (the file's header holds them) and with
        ``certified_radius``; in schema 1 (files written before the header) with its run
        settings."""
        per_eps = {name: {eps_key(e): getattr(r, field) for e, r in self.results.items()
                          if name in ALWAYS_WRITTEN or getattr(r, field) is not None}
                   for name, field in PER_EPS_FIELDS.items()}
        values = {
            "index": self.index, "label": self.label, "prediction": self.prediction,
            "margin": self.margin, "radius": self.radius, "verdicts": per_eps["verdicts"],
            "bounds": per_eps["bounds"], "verifiers": per_eps["verifiers"],
            "reasons": per_eps["reasons"], "rule": self.rule, "seconds": self.seconds,
            "fallback_seconds": per_eps["fallback_seconds"], "run": self.run,
            "falsified": per_eps["falsified"], "counterexamples": per_eps["counterexamples"],
            "fallback": per_eps["fallback"], "adversarial_radius": self.adversarial_radius,
        }
        if schema >= 2:
            del values["run"]
            values["certified_radius"] = self.certified_radius
        return json.dumps(values, allow_nan=False)


# A file's per-eps dicts (keyed by eps_key) -> the EpsResult field each holds. The first three
# hold every eps; the others only the eps where the value exists.
PER_EPS_FIELDS = {"verdicts": "certified", "bounds": "bound", "verifiers": "verifier",
                  "reasons": "reason", "fallback_seconds": "fallback_seconds",
                  "falsified": "falsified", "counterexamples": "counterexample",
                  "fallback": "fallback"}
ALWAYS_WRITTEN = ("verdicts", "bounds", "verifiers")


@dataclass(frozen=True)
class Session:
    """One ``lofast certify`` of a run that certified some of its samples (schema 4): where it
    ran (``runtime.describe_device``) and the seconds of its once-per-model proofs, which no
    record's seconds include."""

    device: str
    proof_seconds: float

    def to_json(self) -> str:
        return json.dumps({"session": {"device": self.device,
                                       "proof_seconds": self.proof_seconds}}, allow_nan=False)


# Every record line starts so (``to_json``'s field order), a header line with HEADER_START, a
# session line with SESSION_START, a finished line with FINISHED_START: a final line without its
# newline that starts so is one torn by an interrupt; anything else is not a record file of ours.
RECORD_START = b'{"index": '
HEADER_START = b'{"schema": '
SESSION_START = b'{"session": '
FINISHED_START = b'{"finished": '

# Field -> accepted JSON types, checked when records are read back (--resume, lofast report).
RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "index": (int,), "label": (int,), "prediction": (int,), "margin": (int, float),
    "radius": (int, float), "verdicts": (dict,), "bounds": (dict,), "verifiers": (dict,),
    "reasons": (dict,), "rule": (str,), "seconds": (int, float), "fallback_seconds": (dict,),
    "run": (dict,),
}
OPTIONAL_FIELDS: dict[str, tuple[type, ...]] = {"falsified": (dict,), "counterexamples": (dict,),
                                                 "fallback": (dict,),
                                                 "adversarial_radius": (int, float, type(None))}


def _lock(handle) -> bool:
    """An exclusive advisory lock on the open file, without waiting; True where taken (or
    where the platform has no flock, which leaves the file unlocked)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return True
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


class RecordWriter:
    """Appends records to a JSONL file and flushes each batch, so an interrupt loses nothing
    that was finished. The file is locked while the run lasts: a second process writing the same
    file is refused rather than interleaving with the first. With resume, records already in the
    file are kept and reported; they must have been made with the same eps values and run
    settings. A file that is not a record file of ours is never modified."""

    def __init__(self, path: Path | None, resume: bool, eps: Sequence[float],
                 run: dict[str, Any]) -> None:
        self.path = path
        self.done: dict[int, SampleRecord] = {}
        self.finished: int | None = None  # the sample count of the file's last line's mark
        self.sessions: list[Session] = []  # the file's, then this run's (schema 4)
        self.handle = None
        if path is None:
            return
        if path.is_dir():
            raise LofastError(f"{path} is a folder; --out names the record file to write")
        if path.exists() and not resume:
            raise LofastError(f"{path} exists; pass --resume to continue it or choose another --out")
        if resume and path.exists():  # opening a FIFO would wait, reading /dev/zero never end
            check_readable(path, "record file")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # "a+b" creates the file, never truncates it, and appends every write
            handle = open(path, "a+b")  # noqa: SIM115 - kept open (and locked) across batches
        except OSError as e:
            raise LofastError(f"cannot write {path}: {e.strerror or e}") from None
        if not _lock(handle):
            handle.close()
            raise LofastError(f"{path} is being written by another lofast process; wait for it "
                              "to finish or choose another --out")
        self.schema = SCHEMA
        try:
            if resume:
                handle.seek(0)
                parsed = parse_records(read_lines(handle, path), path, eps, run)
                self.done, valid = parsed.records, parsed.valid
                self.schema, self.finished = parsed.schema, parsed.finished
                self.sessions = parsed.sessions
                if valid < handle.seek(0, os.SEEK_END):
                    handle.truncate(valid)  # drop the torn last line, nothing else
            self.handle = handle
            if handle.seek(0, os.SEEK_END) == 0:  # a new file: its header first
                self.schema = SCHEMA
                self._append(header_line(eps, run))
        except BaseException:
            handle.close()
            self.handle = None
            raise

    def begin_session(self, session: Session) -> None:
        """Append the line of a session that is about to certify samples (schema 4; a resumed
        file of an earlier schema gets none): a run resumed after its finished mark is open
        again until it finishes."""
        if self.handle is not None and self.schema >= 4:
            self._append(session.to_json() + "\n")
            self.finished = None
        self.sessions.append(session)

    def write(self, records: Iterable[SampleRecord]) -> None:
        """Append records in the file's schema (a schema-1 file resumed stays schema 1)."""
        if self.handle is not None:
            self._append("".join(r.to_json(self.schema) + "\n" for r in records))
            self.finished = None

    def finish(self, samples: int) -> None:
        """Mark the run finished: every one of its ``samples`` samples has a record in the
        file (a file of schema 1 or 2, resumed, has no such mark and gets none; a resumed
        run that found all its samples done adds no second mark of the same count)."""
        if self.handle is not None and self.schema >= 3 and self.finished != samples:
            self._append(finished_line(samples))
            self.finished = samples

    def _append(self, text: str) -> None:
        try:
            self.handle.write(text.encode("utf-8"))
            self.handle.flush()
            os.fsync(self.handle.fileno())
        except OSError as e:
            raise LofastError(f"cannot write {self.path}: {e.strerror or e}; the records written "
                              "before are kept, rerun with --resume") from None

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()  # releases the lock
            self.handle = None


class ContradictoryRecord(ValueError):
    """A record whose fields contradict each other (``_check_consistent``)."""


def _check_consistent(record: SampleRecord) -> None:
    """ContradictoryRecord for a record that contradicts itself, whatever wrote it (a summary
    would count it): a margin whose sign disagrees with the prediction (margin = min_j z_y - z_j
    is > 0 exactly when the label alone wins); a certificate (a radius or a verdict) of a sample
    not classified correctly with a positive margin, which no verifier can give; a
    counterexample within the radius the record certifies, which would make it false."""
    if (record.margin > 0 and record.prediction != record.label) or (
            record.margin < 0 and record.prediction == record.label):
        raise ContradictoryRecord("its margin's sign disagrees with its prediction")
    certified = record.certified_radius > 0 or any(r.certified for r in record.results.values())
    if certified and not record.margin > 0:
        raise ContradictoryRecord("it certifies a sample that is not classified correctly")
    if any(r.falsified and e <= record.certified_radius for e, r in record.results.items()):
        raise ContradictoryRecord("it holds a counterexample within its certified radius")


def record_from_json(values: Any) -> SampleRecord:
    """A SampleRecord from one decoded JSON line; ValueError where a field is missing, unknown,
    of the wrong type, or out of range (a radius that is not a finite number >= 0, an eps key
    that is not a positive radius in its exact text form, verdicts missing), and
    ContradictoryRecord (a ValueError) where its fields contradict each other."""
    if not isinstance(values, dict) or not (
            set(RECORD_FIELDS) <= set(values) <= set(RECORD_FIELDS) | set(OPTIONAL_FIELDS)):
        raise ValueError("not a record")
    for name, types in {**RECORD_FIELDS, **OPTIONAL_FIELDS}.items():
        if name not in values:
            continue
        # bool is an int to Python, never a number to us
        if not isinstance(values[name], types) or isinstance(values[name], bool):
            raise ValueError(f"field {name} has the wrong type")  # noqa: TRY004 - one error kind
    keys = set(values["verdicts"])
    if not keys or not all(_is_eps_key(k) for k in keys):
        raise ValueError("verdicts must be keyed by eps")
    for name in PER_EPS_FIELDS:
        if not set(values.get(name, {})) <= keys:
            raise ValueError(f"{name} has keys that are not the record's eps")
    if not all(isinstance(v, bool) for v in values["verdicts"].values()) or not all(
            isinstance(v, bool) for v in values.get("falsified", {}).values()):
        raise ValueError("verdicts must be true or false")
    if not all(v is None or isinstance(v, str) for v in values["verifiers"].values()):
        raise ValueError("verifiers must be names")
    numbers = [values["margin"], values["radius"], values["seconds"],
               *values["bounds"].values()]
    if values.get("adversarial_radius") is not None:
        numbers.append(values["adversarial_radius"])
    if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                             and math.isfinite(v)) for v in numbers):
        raise ValueError("numbers must be finite")
    if min(values["index"], values["label"], values["prediction"], values["radius"],
           values["seconds"]) < 0:
        raise ValueError("index, label, prediction, radius and seconds must be >= 0")
    per_eps = {name: values.pop(name, {}) for name in PER_EPS_FIELDS}
    values["results"] = {
        float(k): EpsResult(**{field: per_eps[name].get(k)
                               for name, field in PER_EPS_FIELDS.items()})
        for k in per_eps["verdicts"]}
    record = SampleRecord(**values)
    _check_consistent(record)
    return record


def _is_eps_key(key: str) -> bool:
    """Whether key is eps_key(e) of a positive finite radius e."""
    try:
        value = float(key)
    except ValueError:
        return False
    return math.isfinite(value) and value > 0 and eps_key(value) == key


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not a number a record holds")


def header_line(eps: Sequence[float] | Sequence[str], run: dict[str, Any]) -> str:
    """A file's first line: the schema, the eps keys in order and the run settings that every
    record of the file was made with."""
    keys = [k if isinstance(k, str) else eps_key(k) for k in eps]
    return json.dumps({"schema": SCHEMA, "eps": keys, "run": run}, allow_nan=False) + "\n"


def finished_line(samples: int) -> str:
    """The line that marks a run over ``samples`` samples finished (schemas 3 and 4)."""
    return json.dumps({"finished": {"samples": samples}}) + "\n"


def _mark_fields(line: bytes, kind: str, fields: set[str]) -> dict[str, Any] | None:
    """The fields of a line {kind: {fields}} (a session or finished line), or None where the
    line is not valid JSON of exactly that shape."""
    try:
        values = json.loads(line.decode("utf-8"), parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not (isinstance(values, dict) and set(values) == {kind}
            and isinstance(values[kind], dict) and set(values[kind]) == fields):
        return None
    return values[kind]


def _session(line: bytes) -> Session | None:
    """The session of a session line, or None where the line is not one: a device text and
    proof seconds that are a finite number >= 0."""
    values = _mark_fields(line, "session", {"device", "proof_seconds"})
    if values is None:
        return None
    device, seconds = values["device"], values["proof_seconds"]
    if not (isinstance(device, str) and device and type(seconds) in (int, float)
            and math.isfinite(seconds) and seconds >= 0):
        return None
    return Session(device, float(seconds))


def _finished(line: bytes) -> int | None:
    """The sample count of a finished line, or None where the line is not one."""
    values = _mark_fields(line, "finished", {"samples"})
    if values is None:
        return None
    samples = values["samples"]
    return samples if type(samples) is int and samples >= 0 else None


def _header(line: bytes, path: Path) -> tuple[list[str], dict[str, Any], int]:
    """(eps keys, run settings, schema) of a header line; LofastError for one that is not
    ours."""
    try:
        values = json.loads(line.decode("utf-8"), parse_constant=_no_constants)
        ok = (isinstance(values, dict) and set(values) == {"schema", "eps", "run"}
              and isinstance(values["eps"], list) and values["eps"]
              and all(isinstance(k, str) and _is_eps_key(k) for k in values["eps"])
              and isinstance(values["run"], dict))
    except (UnicodeDecodeError, ValueError, RecursionError):
        ok = False
    if not ok:
        raise LofastError(f"{path}:1: not a lofast record file header")
    schema = values["schema"]
    if type(schema) is not int or schema not in READ_SCHEMAS[1:]:
        raise LofastError(f"{path}: record schema {schema!r}; this lofast reads schemas "
                          f"{', '.join(map(str, READ_SCHEMAS))} (a newer lofast wrote it?)")
    return values["eps"], values["run"], schema


class ParsedFile(NamedTuple):
    """What ``parse_records`` reads off a record file."""

    records: dict[int, SampleRecord]  # by sample index
    valid: int  # the length of the file's valid part: all but a torn final line
    schema: int
    finished: int | None  # the sample count of the last line's finished mark, else None
    sessions: list[Session]  # in file order (schema 4)


def parse_records(lines: Iterable[bytes], path: Path, eps: Sequence[float] | None = None,
                  run: dict[str, Any] | None = None) -> ParsedFile:
    """A JSONL file's lines (``files.read_lines``) read as a record file: its schema (2 to 4: a
    header line with the eps and the run settings, then records without them; 1: records
    carrying their run settings), records, sessions (schema 4) and finished mark (3 and 4).
    A file that is not ours, or whose records were made for other eps values or other run
    settings than given (or, where none are given, than its header's or first record's), is
    refused with LofastError naming the file and line."""
    records: dict[int, SampleRecord] = {}
    sessions: list[Session] = []
    keys = None if eps is None else {eps_key(e) for e in eps}
    valid, schema, header_run, finished = 0, 1, None, None
    torn = b""
    for number, line in enumerate(lines, 1):
        if torn:  # a line without its break was not the last one
            raise LofastError(f"{path}:{number - 1}: not a lofast record")
        if not line.endswith(b"\n"):
            torn = line
            continue
        if number == 1 and line.startswith(HEADER_START):
            header_keys, header_run, schema = _header(line, path)
            valid = len(line)
            keys = set(header_keys) if keys is None else keys
            run = header_run if run is None else run
            _check_same(path, set(header_keys), keys, header_run, run)
            continue
        if schema >= 3 and line.startswith(FINISHED_START):
            finished = _finished(line)
            if finished is None or finished > len(records):
                raise LofastError(f"{path}:{number}: not a lofast record file (a finished "
                                  f"run's mark without its records)")
            valid += len(line)
            continue
        # a session or a record after the mark: a resumed run, not yet finished
        finished = None
        if schema >= 4 and line.startswith(SESSION_START):
            session = _session(line)
            if session is None:
                raise LofastError(f"{path}:{number}: not a lofast record file (a session line "
                                  "needs a device and proof seconds >= 0)")
            sessions.append(session)
            valid += len(line)
            continue
        try:
            values = json.loads(line.decode("utf-8"), parse_constant=_no_constants)
            if schema >= 2:  # the header's settings; the certified radius recomputed, checked
                if not isinstance(values, dict) or "run" in values:
                    raise ValueError("not a schema-2 record")
                stated = values.pop("certified_radius", None)
                values["run"] = header_run
            record = record_from_json(values)
            if schema >= 2 and stated != record.certified_radius:
                raise ValueError("certified radius does not match the verdicts")
        except ContradictoryRecord as error:
            raise LofastError(f"{path}:{number}: not a lofast record: {error}") from None
        except (UnicodeDecodeError, ValueError, RecursionError, TypeError):
            raise LofastError(f"{path}:{number}: not a lofast record (a file lofast certify "
                              "--out writes)") from None
        record_keys = {eps_key(e) for e in record.eps}
        keys = record_keys if keys is None else keys
        run = record.run if run is None else run
        _check_same(path, record_keys, keys, record.run, run)
        records[record.index] = record
        valid += len(line)
    if torn and not any(torn.startswith(s) or s.startswith(torn)
                        for s in (RECORD_START, HEADER_START, SESSION_START, FINISHED_START)):
        raise LofastError(f"{path}: not a lofast record file (its last line is not a record); "
                          "--resume continues only a file that lofast certify wrote")
    if torn:  # a line cut off after the mark: a resumed run stopped while writing
        finished = None
    return ParsedFile(records, valid, schema, finished, sessions)


def _check_same(path: Path, keys: set[str], expected: set[str], run: dict[str, Any],
                expected_run: dict[str, Any]) -> None:
    """Refuse records made for other eps values or run settings than those expected."""
    if keys != expected:
        raise LofastError(f"{path}: was written for eps {sorted(keys)}, not "
                          f"{sorted(expected)}; resume with the same --eps values")
    # a setting a record lacks is one it was made without (None), as the run may say
    changed = [k for k in sorted(set(run) | set(expected_run)) if run.get(k) != expected_run.get(k)]
    if changed:
        detail = ", ".join(f"{k} {run.get(k)} (now {expected_run.get(k)})" for k in changed)
        raise LofastError(f"{path}: was written with other settings: {detail}; resume with "
                          "the same settings or choose another --out")


@dataclass(frozen=True)
class SavedRun:
    """A record file's records, in file order, whether its run finished (True where its last
    line marks it so, False where the run stopped before: an interrupt, a crash, a killed job;
    None for a file of schema 1 or 2, which does not say) and its sessions (none in a file of
    schema 1 to 3, which does not say where it ran)."""

    records: list[SampleRecord]
    finished: bool | None
    sessions: tuple[Session, ...] = ()


def load_run(path: Path, allow_empty: bool = False) -> SavedRun:
    """One `lofast certify --out` file (a torn last line left by an interrupt is skipped);
    LofastError for a missing or foreign file, one that is not a regular file (a FIFO, a
    device), or one without records unless ``allow_empty`` (a shard that had no samples)."""
    path = Path(path)
    check_readable(path, "record file")
    try:
        with open(path, "rb") as handle:
            parsed = parse_records(read_lines(handle, path), path)
    except OSError as e:
        raise LofastError(f"cannot read {path}: {e.strerror or e}") from None
    if not parsed.records and not allow_empty:
        raise LofastError(f"{path}: holds no records")
    return SavedRun(list(parsed.records.values()),
                    parsed.finished is not None if parsed.schema >= 3 else None,
                    tuple(parsed.sessions))


def read_run(path: Path, allow_empty: bool = False) -> list[SampleRecord]:
    """The records of one `lofast certify --out` file, in file order (``load_run``)."""
    return load_run(path, allow_empty).records


def write_records(path: Path, records: Sequence[SampleRecord],
                  sessions: Sequence[Session] = ()) -> None:
    """Write the records of one whole run (all its samples) and the sessions that made them as
    one JSONL file of this schema (its header from the first record, marked finished),
    atomically (a temporary file renamed into place)."""
    if not records:
        raise LofastError(f"no records to write to {path}")
    lines = (header_line(records[0].eps, records[0].run)
             + "".join(session.to_json() + "\n" for session in sessions)
             + "".join(record.to_json() + "\n" for record in records)
             + finished_line(len(records)))
    atomic_write(Path(path), lambda tmp: Path(tmp).write_text(lines, encoding="utf-8"))


def merge_runs(runs: Sequence[Sequence[SampleRecord]]) -> list[SampleRecord]:
    """The records of the parts of one run, by sample index, as one whole run (its records no
    longer name a shard). Refused, naming what is wrong: parts made with other eps values or
    settings, parts that disagree on a sample, and a set of shards that is not complete and
    consistent (every part I of N present once with all its samples, of runs over the same
    number of samples; a part with no samples may be absent or empty)."""
    records = [record for part in runs for record in part]
    if not records:
        raise LofastError("the runs to merge hold no records")
    first = records[0]
    whole = _unsharded(first.run)
    for record in records:
        if set(record.eps) != set(first.eps) or _unsharded(record.run) != whole:
            raise LofastError("the runs to merge were made with other eps values or "
                              "settings; merge only the parts of one run")
    shards = [record.run.get("shard") for record in records]
    if any(shard is not None for shard in shards):
        _check_complete(shards)
    merged: dict[int, SampleRecord] = {}
    for record in records:
        if record.index in merged:
            same = all(merged[record.index].results[e].certified == r.certified
                       for e, r in record.results.items())
            raise LofastError(f"sample {record.index} is in two of the parts"
                              + ("" if same else ", with other verdicts"))
        merged[record.index] = dataclasses.replace(record, run=whole)
    return [merged[i] for i in sorted(merged)]


def merge_saved_runs(parts: Sequence[SavedRun]) -> SavedRun:
    """``merge_runs`` of saved parts, finished where the whole is (shards by ``merge_runs``'
    check of their counts, whole runs where every one finished; False where one did not, None
    where one does not say), with the sessions of all parts."""
    records = merge_runs([part.records for part in parts])
    marks = [part.finished for part in parts]
    if any(r.run.get("shard") is not None for part in parts for r in part.records):
        finished = True
    elif False in marks:
        finished = False
    else:
        finished = None if None in marks else True
    return SavedRun(records, finished, tuple(s for part in parts for s in part.sessions))


def _unsharded(run: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in run.items() if key != "shard"}


def _check_complete(shards: Sequence[dict[str, int] | None]) -> None:
    """Refuse shards (``run["shard"]`` of every record) that are not all parts I of one N of a
    run over one number of samples, each with all its samples (part I has the samples
    I, I + N, ... below that number)."""
    if any(shard is None for shard in shards):
        raise LofastError("the runs to merge mix shards with a whole run")
    counts = {(shard["parts"], shard["samples"]) for shard in shards}
    if len(counts) > 1:
        detail = ", ".join(f"of {n} parts over {total} samples" for n, total in sorted(counts))
        raise LofastError(f"the shards to merge come from different runs ({detail})")
    (parts, total), = counts
    found = collections.Counter(shard["part"] for shard in shards)
    wrong = [f"{i}/{parts} ({found[i]} of {len(range(i, total, parts))} samples)"
             for i in range(parts) if found[i] != len(range(i, total, parts))]
    if wrong:
        raise LofastError(f"the shards do not make one run of {total} samples: "
                          f"{', '.join(wrong)}; merge every part once")
