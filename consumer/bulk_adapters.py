"""Many adapters in one `lorabatch adapters add`: the folders a call names, their checks in parallel, their registration
in a few transactions, and each failure reported by path without stopping the rest.

What a call names (README "Registering many adapters"):
  NAME DIR          one adapter folder, registered as NAME (the single form);
  --dir ROOT        every entry of ROOT, named after it (entries whose name starts with '.' are skipped);
  --glob PATTERN    every path PATTERN matches (Python's glob; `**` spans folders), named after its last part;
  --manifest FILE   JSON lines, one adapter a line: {"name": ..., "path": ...} and optionally "tenant", "default",
                    "public", "canary"; a relative path is taken from FILE's folder.
The command line's --tenant, --public and --canary apply to every adapter a manifest line does not set them for.

Steps: (1) collect the items; a source that cannot be read or names nothing ends the call (BulkError) before anything is
written; (2) refuse, item by item, what needs no file: a bad name, an unknown tenant, a bad canary, one tenant and name
twice in the call, two defaults for one tenant, a name made public that another tenant has public (or that several make
public in the call); (3) check and store the rest in parallel (engine.adapter_import: a failing folder leaves nothing in
the store); (4) register what was stored, `batch` adapters a transaction
(Registry.register): a new name or new content is registered, the same content under the same name is unchanged.
"""

from __future__ import annotations

import glob
import json
import os
import reprlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from sqlalchemy.exc import DBAPIError

from consumer.files import FileUnfit, read_bounded, shown_size
from consumer.registry import (AdapterView, Registration, Registry, RegistryError, canary_problem, name_problem,
                               public_name_problem)
from engine.adapter_import import AdapterChecks, Imported, import_adapters
from engine.api import AdapterError

BATCH = 500  # adapters a transaction: 2,000 in 4 (a statement's bind parameters stay far under SQLite's 32,766)
MANIFEST_KEYS = ("name", "path", "tenant", "default", "public", "canary")
_MANIFEST_EXAMPLE = '{"name": "support", "path": "adapters/support", "default": true}'
# A manifest line is about 100-200 bytes: 64 MiB holds some 300,000 adapters, and a larger file is split (--manifest
# repeats). Read whole, so /dev/zero was read until memory ran out.
MANIFEST_MAX_BYTES = 64 << 20
_SHOWN = reprlib.Repr()  # a wrong value as reports show it: a line's nested or long value is cut, not printed whole
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 3, 80, 80


class BulkError(Exception):
    """The call as a whole cannot go on (a source is missing, unreadable or empty); nothing was written."""

    retriable = False


@dataclass(frozen=True)
class Flags:
    """The command line's --tenant, --public and --canary: what an item takes unless its manifest line says."""

    tenant_id: str | None = None
    public: bool = False
    canary: int | None = None


@dataclass(frozen=True)
class Item:
    """One adapter the call names."""

    origin: str  # how reports name it: the folder as given, and for a manifest line, the line too
    path: Path
    name: str
    tenant_id: str | None
    default: bool = False
    public: bool = False
    canary: int | None = None
    named_by_folder: bool = True  # the name is the folder's (--dir, --glob): a bad one is fixed by renaming it


@dataclass(frozen=True)
class Failure:
    origin: str
    reason: str


@dataclass(frozen=True)
class Done:
    item: Item
    view: AdapterView
    created: bool  # False: the same content was that name's latest version already


Entry = Item | Failure


def from_folder(name: str, path: Path, flags: Flags, *, default: bool = False) -> list[Entry]:
    """The single form: `path` as `name`."""
    return [Item(str(path), Path(path), name, flags.tenant_id, default, flags.public, flags.canary, named_by_folder=False)]


def from_dir(root: Path, flags: Flags) -> list[Entry]:
    """Every entry of `root` but hidden ones, by name: a file or a broken link among them fails as an item."""
    root = Path(root)
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a folder (a manifest goes with --manifest)"
        raise BulkError(f"--dir {root} {what}; give the folder that holds the adapter folders")
    if (root / "adapter_config.json").exists():
        raise BulkError(f"--dir {root} is itself an adapter folder (it holds adapter_config.json); register it with "
                        f"`lorabatch adapters add --tenant T NAME {root}`, or give the folder above it")  # fmt: skip
    try:
        names = sorted(e.name for e in os.scandir(root) if not e.name.startswith("."))
    except OSError as e:
        raise BulkError(f"--dir {root} cannot be listed ({e.strerror}); check its permissions") from e
    if not names:
        raise BulkError(f"--dir {root} holds no adapter folders")
    return [Item(str(root / n), root / n, n, flags.tenant_id, False, flags.public, flags.canary) for n in names]


def from_glob(pattern: str, flags: Flags) -> list[Entry]:
    """Every path `pattern` matches, in order, named after its last part."""
    matches = sorted(glob.glob(pattern, recursive=True))
    if not matches:
        raise BulkError(f"--glob {pattern!r} matches nothing; quote the pattern so that the shell hands it over unexpanded")
    return [Item(m, Path(m), Path(m).name, flags.tenant_id, False, flags.public, flags.canary) for m in matches]


def from_manifest(file: Path, flags: Flags) -> list[Entry]:
    """One item per JSON line of `file`; a line that is not a valid one is a failure in its place."""
    file = Path(file)
    try:
        text = read_bounded(file, what="--manifest", limit=MANIFEST_MAX_BYTES,
                            fix=f"give a regular JSON lines file of at most {shown_size(MANIFEST_MAX_BYTES)}, and split a "
                                f"larger one into several (--manifest may be given more than once)").decode("utf-8-sig")
        # utf-8-sig: a byte order mark, as some editors write, is no part of line 1
    except FileUnfit as e:
        raise BulkError(str(e)) from e
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise BulkError(f"--manifest {file} cannot be read ({why}); give a JSON lines file, one adapter a line: "
                        f"{_MANIFEST_EXAMPLE}") from e  # fmt: skip
    entries: list[Entry] = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            entries.append(_manifest_line(line, f"{file} line {number}", file.parent, flags))
    if not entries:
        raise BulkError(f"--manifest {file} holds no lines; write one adapter a line: {_MANIFEST_EXAMPLE}")
    return entries


def _manifest_line(line: str, where: str, base: Path, flags: Flags) -> Entry:
    def bad(what: str) -> Failure:
        return Failure(where, f"{what}; write one JSON object a line, e.g. {_MANIFEST_EXAMPLE}")

    try:
        obj = json.loads(line, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        return bad(f"not JSON ({e.msg} at column {e.colno})")
    except ValueError:  # int()'s own, not a JSONDecodeError: it aborted the whole call with a traceback
        return bad("a number of more than 4,300 digits, which no key takes")
    except _DuplicateKey as e:  # json keeps the last silently: which one was meant is not for us to guess
        return bad(f"key {e.key!r} is given twice; give each key once")
    except RecursionError:  # the decoder nests a call per array or object: thousands deep exhaust the stack
        return bad("nested too deeply to read (arrays or objects within each other thousands deep)")
    if not isinstance(obj, dict):
        return bad(f"a JSON {type(obj).__name__}, not an object")
    unknown = sorted(set(obj) - set(MANIFEST_KEYS))
    if unknown:
        return bad(f"unknown key {', '.join(map(repr, unknown))} (a line holds {', '.join(MANIFEST_KEYS)})")
    for key in ("name", "path"):
        if not isinstance(obj.get(key), str) or not obj[key]:
            return bad(f"{key!r} must be a non-empty string, found {_SHOWN.repr(obj.get(key))}")
    for key in ("default", "public"):
        if key in obj and not isinstance(obj[key], bool):
            return bad(f"{key!r} must be true or false, found {_SHOWN.repr(obj[key])}")
    if "canary" in obj and (not isinstance(obj["canary"], int) or isinstance(obj["canary"], bool)):
        return bad(f"'canary' must be a whole percentage from 1 to 99, found {_SHOWN.repr(obj['canary'])}")
    if "tenant" in obj and (not isinstance(obj["tenant"], str) or not obj["tenant"]):
        return bad(f"'tenant' must be a non-empty string, found {_SHOWN.repr(obj['tenant'])}")
    path = base / obj["path"]  # an absolute path stays itself
    return Item(f"{path} ({where})", path, obj["name"], obj.get("tenant", flags.tenant_id), obj.get("default", False),
                obj.get("public", flags.public), obj.get("canary", flags.canary), named_by_folder=False)  # fmt: skip


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """json.loads' object_pairs_hook: an object, or _DuplicateKey for a key it holds twice."""
    obj: dict[str, object] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def refuse_early(entries: list[Entry], registry: Registry) -> list[Entry]:
    """`entries` with each item that fails for a reason no file is needed for replaced by its Failure."""
    out = list(entries)
    items = [(i, e) for i, e in enumerate(out) if isinstance(e, Item)]
    known = registry.existing_tenants({e.tenant_id for _, e in items if e.tenant_id is not None})
    for i, item in items:
        reason = _item_problem(item, known)
        if reason is not None:
            out[i] = Failure(item.origin, reason)
    by_key: dict[tuple[str, str], list[int]] = defaultdict(list)
    defaults: dict[str, list[int]] = defaultdict(list)
    for i, e in enumerate(out):
        if isinstance(e, Item):
            by_key[(e.tenant_id, e.name)].append(i)
            if e.default:
                defaults[e.tenant_id].append(i)
    for (tenant, name), where in by_key.items():
        if len(where) > 1:  # which one was meant is not for us to guess: none is registered
            for i in where:
                others = "; ".join(out[j].origin for j in where if j != i)
                out[i] = Failure(out[i].origin, f"{tenant}/{name} is named {len(where)} times in this call (also {others}); "
                                                "give each adapter its own name")  # fmt: skip
    for tenant, where in defaults.items():
        where = [i for i in where if isinstance(out[i], Item)]
        if len(where) > 1:
            names = ", ".join(out[i].name for i in where)
            for i in where:
                out[i] = Failure(out[i].origin, f"{len(where)} adapters of tenant {tenant} are marked default in this call "
                                                f"({names}); a tenant has one default: mark one")  # fmt: skip
    return _refuse_public_clashes(out, registry)


def _refuse_public_clashes(out: list[Entry], registry: Registry) -> list[Entry]:
    """A name is public for one tenant at most (registry.public_name_problem): an item made public under a name another
    tenant has public already fails, and so does each of several tenants' items making one name public in this call."""
    public: dict[str, list[int]] = defaultdict(list)
    for i, e in enumerate(out):
        if isinstance(e, Item) and e.public:
            public[e.name].append(i)
    owners = registry.public_owners(public)
    for name, where in public.items():
        tenants = sorted({out[i].tenant_id for i in where})
        for i in where:
            problem = public_name_problem(out[i].tenant_id, name, owners.get(name, ()))
            if problem is None and len(tenants) > 1:
                problem = (f"tenants {', '.join(tenants)} each make adapter name {name!r} public in this call, and a name "
                           "can be public for one tenant only; give the others another name, or keep them private")  # fmt: skip
            if problem is not None:
                out[i] = Failure(out[i].origin, problem)
    return out


def _item_problem(item: Item, known_tenants: set[str]) -> str | None:
    if (problem := name_problem(item.name)) is not None:
        fix = "rename the folder, or name it in a --manifest line" if item.named_by_folder else "fix the name"
        return f"adapter name {problem}: {fix}"
    if item.tenant_id is None:
        return "no tenant: pass --tenant, or give the manifest line a \"tenant\""
    if item.tenant_id not in known_tenants:
        return f"tenant {item.tenant_id!r} does not exist; add it with `lorabatch tenants add {item.tenant_id}`"
    return canary_problem(item.canary)


def register_all(registry: Registry, entries: list[Entry], checks: AdapterChecks, *, threads: int, batch: int = BATCH,
                 checked: Callable[[], None] | None = None,
                 registered: Callable[[int, int], None] | None = None) -> list[Done | Failure]:  # fmt: skip
    """Steps 3-4 of the module docstring for the items of `entries` (as `refuse_early` left them): a Done or a Failure
    for each entry, in order. `checked` is called as each adapter's check ends, `registered` with the size of each batch
    registered and how many passed their checks (progress bars)."""
    assert batch >= 1, batch
    out: list[Done | Failure | Item] = list(entries)
    todo = [i for i, e in enumerate(out) if isinstance(e, Item)]
    imports = import_adapters([out[i].path for i in todo], registry.store, checks, threads=threads, done=checked)
    stored: list[tuple[int, Imported]] = []
    for i, result in zip(todo, imports):
        if isinstance(result, Imported):
            stored.append((i, result))
        else:
            out[i] = Failure(out[i].origin, _failure_reason(result, out[i].path))
    for start in range(0, len(stored), batch):
        chunk = stored[start : start + batch]
        regs = [_registration(out[i], imported) for i, imported in chunk]
        try:
            views = registry.register(regs)
        except (DBAPIError, RegistryError) as e:  # this batch's transaction is rolled back whole; later ones still try
            reason = (f"not registered: the ledger database failed ({' '.join(str(getattr(e, 'orig', None) or e).split())}); "
                      "its content is in the store: run the command again") if isinstance(e, DBAPIError) else str(e)  # fmt: skip
            for i, _ in chunk:
                out[i] = Failure(out[i].origin, reason)
        else:
            for (i, _), (view, created) in zip(chunk, views):
                out[i] = Done(out[i], view, created)
        if registered is not None:
            registered(len(chunk), len(stored))
    assert not any(isinstance(e, Item) for e in out), "every item ends done or failed"
    return out  # type: ignore[return-value]


def _registration(item: Item, imported: Imported) -> Registration:
    return Registration(item.tenant_id, item.name, imported.sha256, imported.rank, Decimal(str(imported.alpha)),
                        imported.target_modules, imported.nbytes, item.default, item.public, item.canary)  # fmt: skip


def _failure_reason(e: AdapterError | OSError, path: Path) -> str:
    if isinstance(e, AdapterError):
        return str(e).removeprefix(f"{path}: ")  # the report names the path before the reason already
    what = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e)
    return f"cannot read it ({what}); check the path and its permissions"

