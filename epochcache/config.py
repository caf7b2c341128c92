"""Configuration: the validated form of config.yaml.

Flow: ``load_config(path, overrides, env)`` merges, lowest precedence first, the models' defaults,
the YAML file, ``EPOCHCACHE_SECTION__KEY`` environment variables (a double underscore between section
and key; other ``EPOCHCACHE_*`` names are ignored) and ``section.key=value`` overrides
(CLI flags), then validates the result into a frozen :class:`Config`. Every section rejects unknown
keys; the YAML file, a key written twice; a URL, a scheme fsspec does not know. Sizes accept
integers or strings such as ``"64MB"`` (10**6) and ``"64MiB"`` (2**20).
Relative local paths (``cache.dir``, a scheme-less ``source.url``) are resolved against the directory
of the YAML file, so a config means the same thing from any working directory.

Invariant: a :class:`Config` that exists is valid; every error is a :class:`ConfigError` whose one-line
message names where the bad value was written (the YAML file, ``environment variable EPOCHCACHE_...``
or ``--set key=value`` as given), the dotted key path and the value, with secrets masked
(:mod:`epochcache.redact`).
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Hashable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from epochcache.cache.ledger import LEDGER_RESERVE
from epochcache.errors import ConfigError
from epochcache.redact import MASK, is_secret_name, redact_text

ENV_PREFIX = "EPOCHCACHE_"
# The single `source:` is validated as entry 0 of `sources`; errors name it as the user wrote it.
_SHORTHAND = re.compile(r"\bsources\.0(?=[.:= ]|$)")
# What a size error advises, whatever pydantic could not parse (a word, a negative number, '').
# The footers' share of the budget (cache.footer_bytes): auto gives max_bytes/64 within these bounds.
FOOTER_STORE_LEAST = 2**20
FOOTER_STORE_MOST = 64 * 2**20
_SIZE_HINT = "give a number of bytes > 0 or a size such as 20GB (20*10**9) or 20GiB (20*2**30)"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _resolve_local(value: str, info: ValidationInfo) -> str:
    """Make a scheme-less relative path absolute against the config file's directory; a URL's
    scheme must be one fsspec knows (checked here, so a typo fails at load, not deep in a read)."""
    if "://" in value:
        _check_schemes(value)
        return value
    if os.path.isabs(value):
        return value
    base = (info.context or {}).get("base_dir")
    return str(Path(base or ".").joinpath(value).resolve())


def _check_schemes(url: str) -> None:
    """Refuse a URL (or a chained ``a::b://...`` URL) naming a protocol fsspec does not know."""
    import fsspec  # only for a URL: importing the trainer's modules stays free of it

    known = fsspec.available_protocols()
    for link in url.split("::"):
        scheme = link.split("://", 1)[0] if "://" in link else None
        if scheme is not None and scheme not in known:
            close = difflib.get_close_matches(scheme, known, n=1, cutoff=0.5)
            guess = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown URL scheme {scheme!r}{guess}: give a protocol fsspec knows, such as "
                             "s3://, gs://, az://, https:// or file://, or a local path")


class SourceConfig(_Section):
    """Where the remote dataset lives and how to read it."""

    url: str = Field(description="fsspec URL or local path of a data file or a folder of them")
    format: Literal["parquet", "arrow", "webdataset", "objects"] = Field(
        default="parquet",
        description="parquet: units are row groups; arrow (IPC/Feather v2): record batches; webdataset: "
        "tars; objects: one sample per object",
    )
    labels: str | None = Field(
        default=None,
        description="format objects: 'folder' (int32 label = index of the object's top folder among the sorted "
        "folders under url, plus label_name), or a CSV/JSONL/Parquet table of key -> columns",
    )
    columns: list[str] | None = Field(default=None, min_length=1, description="columns to fetch; null = all")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments for the fsspec filesystem (s3fs, ...)"
    )
    name: str = Field(
        default="", pattern=r"^([A-Za-z0-9_-]+)?$",
        description="names this source's cursor, listing and progress keys; '' for the single `source:`",
    )
    weight: float = Field(default=1.0, description="share of the rows written, relative to the other sources")

    @field_validator("url")
    @classmethod
    def _url(cls, value: str, info: ValidationInfo) -> str:
        if not value.strip():
            raise ValueError("must not be empty: give an fsspec URL such as s3://bucket/prefix/")
        return _resolve_local(value, info)

    @field_validator("weight")
    @classmethod
    def _weight(cls, value: float) -> float:
        if not (math.isfinite(value) and value > 0):
            raise ValueError("must be a finite number > 0 (weights are relative: 1 and 3 give 25% and 75%)")
        return value

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: str | None, info: ValidationInfo) -> str | None:
        return value if value in (None, "folder") else _resolve_local(value, info)

    @model_validator(mode="after")
    def _labels_need_objects(self) -> SourceConfig:
        if self.labels is not None and self.format != "objects":
            raise ValueError(f"labels={self.labels!r} applies only to format 'objects', not {self.format!r}: "
                             "remove source.labels or set source.format: objects")
        return self


class CacheConfig(_Section):
    """The local shard cache and its hard byte budget."""

    dir: str = Field(description="cache directory: shard files plus the ledger")
    max_bytes: ByteSize = Field(default=ByteSize(10 * 10**9), description="hard disk budget")
    shard_bytes: ByteSize = Field(default=ByteSize(64 * 10**6), description="target shard size")
    eviction: Literal["fifo", "lru", "most-used", "random"] = Field(
        default="fifo", description="which shards go first when room is needed"
    )
    max_uses: int | None = Field(
        default=None, ge=1, description="shards used by this many epochs go first, whatever the policy; null = off"
    )
    min_uses: int = Field(
        default=1, ge=0,
        description="a shard is not evicted before this many epochs used it (with none training, the daemon "
        "fills the budget once and waits: fetching is bounded by training); 0 = rotate regardless",
    )
    low_watermark: Annotated[float, Field(gt=0.0, le=1.0)] | Literal["auto"] = Field(
        default="auto",
        description="once room must be made, evict down to this fraction of max_bytes; auto: as low as keeps "
        "90% of max_bytes in shards for the next epoch",
    )
    footer_bytes: Annotated[ByteSize, Field(ge=0)] | Literal["auto"] = Field(
        default="auto",
        description="part of max_bytes kept for the footers of Parquet and Arrow IPC files read over S3, so each "
        "is read once per version, not again each pass, each daemon start, or each unit of a mixing window of "
        "over 256 objects; auto: max_bytes/64, at most 64MiB and what two shards and the ledger leave (none "
        "under 1MiB); 0 = none (else at least 1MiB)",
    )

    @field_validator("dir")
    @classmethod
    def _dir(cls, value: str, info: ValidationInfo) -> str:
        return _resolve_local(value, info)

    @field_validator("shard_bytes")
    @classmethod
    def _shard_bytes(cls, value: ByteSize) -> ByteSize:
        if value < 2**16:
            raise ValueError(f"{int(value)} bytes is too small for a shard: use at least 64KiB")
        return value

    @model_validator(mode="after")
    def _budget_holds_two_shards(self) -> CacheConfig:
        minimum = self._least_for_shards() + (0 if self.footer_bytes == "auto" else int(self.footer_bytes))
        if self.max_bytes < minimum:
            raise ValueError(
                f"max_bytes={int(self.max_bytes)} cannot hold two shards of shard_bytes="
                f"{int(self.shard_bytes)} plus the ledger and footer_bytes: raise cache.max_bytes to at least "
                f"{minimum} or lower cache.shard_bytes"
            )
        if self.footer_bytes != "auto" and 0 < self.footer_bytes < FOOTER_STORE_LEAST:
            raise ValueError(f"footer_bytes={int(self.footer_bytes)} is too small to keep footers in: use 0 for "
                             f"none, or at least {FOOTER_STORE_LEAST} (1MiB)")
        return self

    def _least_for_shards(self) -> int:
        # One published shard plus the one being written must fit beside the ledger (its reserve and
        # as much again for the database's growth), or the daemon could never publish.
        return 2 * int(self.shard_bytes) + 2 * LEDGER_RESERVE

    def footer_charge(self) -> int:
        """Bytes of ``max_bytes`` set apart for footers (:class:`epochcache.sources.footers.FooterStore`
        stays within them): ``footer_bytes``, with auto resolved; 0 for none. Auto never takes what
        two shards and the ledger need."""
        if self.footer_bytes != "auto":
            return int(self.footer_bytes)
        auto = min(FOOTER_STORE_MOST, int(self.max_bytes) // 64, int(self.max_bytes) - self._least_for_shards())
        return auto if auto >= FOOTER_STORE_LEAST else 0

    def shard_budget(self) -> int:
        """Bytes the shards, the shard being written and the ledger may take: ``max_bytes`` less the
        footers' share."""
        return int(self.max_bytes) - self.footer_charge()


class SamplerConfig(_Section):
    """How the sync daemon draws units from the remote."""

    seed: int = Field(default=0, ge=0)
    concurrency: int = Field(default=8, ge=1, le=256, description="remote reads in flight")
    max_inflight_bytes: ByteSize = Field(
        default=ByteSize(256 * 2**20), gt=0,
        description="most bytes of units (by their metadata's size) read or being read but not yet in a "
        "shard, with concurrency; a larger unit is read alone",
    )
    whole_object_bytes: ByteSize = Field(
        default=ByteSize(8 * 2**20), ge=0,
        description="Arrow IPC and Parquet (every column) objects up to this size are read in one GET, checked "
        "whole against the store's checksum where it offers one (an MD5 ETag), and held (mix_units of them, "
        "within max_inflight_bytes) until each of their units is read; larger ones are read in ranges, one "
        "per unit; 0 = ranges only",
    )
    max_bytes_per_s: ByteSize | None = Field(
        default=None, gt=0, description="cap on the daemon's intake (decoded Arrow bytes/s); null = none"
    )
    mix_units: Annotated[int, Field(ge=1, le=1024)] | Literal["auto"] = Field(
        default=8,
        description="objects whose units are interleaved; auto: as many as the cache holds (at most 1024)",
    )
    row_fraction: Annotated[float, Field(gt=0.0, le=1.0)] | Literal["auto"] = Field(
        default=1.0,
        description="keep a seeded 1/ceil(1/f) of each unit's rows per pass (each row once over that many "
        "passes): the cache spans that many times more units, for that many times the remote reads; auto: "
        "from the remote's size as cached and the budget, so that an epoch's cache spans the remote (at most 1/64)",
    )
    node_rank: int | None = Field(default=None, ge=0, description="this node's rank; null = GROUP_RANK or 0")
    num_nodes: int | None = Field(
        default=None, ge=1, description="nodes splitting the order; null = WORLD_SIZE/LOCAL_WORLD_SIZE or 1"
    )
    max_attempts: int = Field(
        default=6, ge=1, le=100,
        description="attempts per remote read; a unit still failing (or corrupt) is skipped, read again at pass end",
    )
    backoff_s: float = Field(default=0.2, gt=0.0, description="first backoff ceiling; doubles per retry")
    backoff_max_s: float = Field(default=20.0, gt=0.0, description="largest backoff ceiling")
    # 10 s: a read timeout bounds a silence between two packets, so a slow link never hits it, while an
    # endpoint that never answers costs 10 s per attempt, not a minute. A whole read also gets twice this
    # plus its size at 64 KiB/s (epochcache.sources.remote), so bytes trickling in cannot hold a unit forever.
    request_timeout_s: float = Field(
        default=10.0, gt=0.0,
        description="connect timeout and longest silence within one request (S3); a read also gets twice this "
        "plus its size at 64 KiB/s in all",
    )
    max_sample_bytes: ByteSize = Field(
        default=ByteSize(256 * 2**20), gt=0,
        description="largest sample (a tar member, an object) read; a larger one is skipped with its reason",
    )

    @model_validator(mode="after")
    def _rank_below_nodes(self) -> SamplerConfig:
        if self.node_rank is not None and self.num_nodes is not None and self.node_rank >= self.num_nodes:
            raise ValueError(
                f"node_rank={self.node_rank} must be below num_nodes={self.num_nodes}: ranks run 0..num_nodes-1"
            )
        return self

    @model_validator(mode="after")
    def _whole_objects_fit(self) -> SamplerConfig:
        # Objects read whole are held a mixing window at a time, within max_inflight_bytes. Unset, the
        # default is lowered to what fits (epochcache.sources.open_source), as it is with mix_units auto.
        window = self.mix_units if isinstance(self.mix_units, int) else 1
        if "whole_object_bytes" in self.model_fields_set and window * self.whole_object_bytes > self.max_inflight_bytes:
            raise ValueError(
                f"whole_object_bytes={int(self.whole_object_bytes)} times mix_units={window} exceeds "
                f"max_inflight_bytes={int(self.max_inflight_bytes)}, within which a mixing window of objects read "
                "whole is held: lower whole_object_bytes or mix_units, or raise max_inflight_bytes"
            )
        return self

    def partition(self, env: Mapping[str, str] | None = None) -> tuple[int, int]:
        """``(node_rank, num_nodes)``: the configured values, else those torchrun sets in ``env``
        (``GROUP_RANK``; ``WORLD_SIZE // LOCAL_WORLD_SIZE``), else ``(0, 1)``."""
        env = os.environ if env is None else env
        rank = self.node_rank if self.node_rank is not None else int(env.get("GROUP_RANK", 0))
        nodes = self.num_nodes
        if nodes is None:
            nodes = int(env.get("WORLD_SIZE", 1)) // max(1, int(env.get("LOCAL_WORLD_SIZE", 1))) or 1
        if not 0 <= rank < nodes:
            raise ConfigError(
                f"sampler.node_rank={rank} (from config or GROUP_RANK) is not below sampler.num_nodes={nodes}: "
                "set both, or run under torchrun"
            )
        return rank, nodes


class LoaderConfig(_Section):
    """How EpochCachedLoader builds each epoch."""

    batch_size: int = Field(default=64, ge=1)
    # None: chosen per loader, 0 (a batch thread) without a transform, 2 worker processes with one.
    num_workers: int | None = Field(default=None, ge=0)
    prefetch_batches: int = Field(default=2, ge=1)
    pin_memory: bool = False
    # glibc's mmap and trim thresholds fixed in the training process (epochcache.train.malloc)
    fixed_malloc_thresholds: bool = True
    device: str | None = Field(default=None, pattern=r"^(cpu|cuda|mps|xpu)(:\d+)?$")
    epoch_samples: int | None = Field(default=None, ge=1)
    replacement: bool = False
    min_samples: int = Field(default=0, ge=0)
    shuffle: bool = True
    drop_last: bool = False
    seed: int = Field(default=0, ge=0)
    columns: list[str] | None = Field(default=None, min_length=1)
    # None: the next epoch is prepared by time (epochcache.train.timing); a fraction: at that point.
    prepare_next_at: float | None = Field(default=None, gt=0.0, le=1.0)
    lease_ttl_s: float = Field(default=60.0, gt=0.0)
    wait_timeout_s: float = Field(default=600.0, gt=0.0)
    # Open memory maps kept per loader: vm.max_map_count (65,530 by default) bounds them per process,
    # and an epoch may span far more shards; past this many, the least recently used is unmapped.
    max_open_shards: int = Field(default=1024, ge=1)
    # Shard pages each reading process keeps mapped (epochcache.train.mappings); None: no bound.
    max_mapped_bytes: ByteSize | None = Field(default=None, gt=0)


class Config(_Section):
    """The whole of config.yaml.

    ``source:`` (one source) is shorthand for a one-element ``sources:`` list whose entry is named
    ``''`` with weight 1, so a cache made with it keeps its ledger keys. In a ``sources:`` list every
    entry needs a ``weight`` > 0; names default to ``source<i>`` and must be unique, and no two
    sources may share a URL (every unit key names its object, so keys stay unique across sources).
    """

    sources: tuple[SourceConfig, ...]
    cache: CacheConfig
    sampler: SamplerConfig = SamplerConfig()
    loader: LoaderConfig = LoaderConfig()

    @model_validator(mode="before")
    @classmethod
    def _one_source_or_a_list(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "source" in data and "sources" in data:
            raise ValueError("give either source: (one source) or sources: (a list with weights), not both")
        if "source" in data:
            single = data["source"]
            if isinstance(single, dict) and "weight" in single:
                raise ValueError("source.weight applies only to entries of a sources: list; remove it")
            return {**{k: v for k, v in data.items() if k != "source"}, "sources": [single]}
        if "sources" not in data:
            raise ValueError("required key is missing: give source: (one source) or sources: (a list)")
        entries = data["sources"]
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"sources = {entries!r}: give a non-empty list of sources, each with url and weight")
        return {**data, "sources": [_named(entry, index) for index, entry in enumerate(entries)]}

    @model_validator(mode="after")
    def _distinct_sources(self) -> Config:
        for key in ("name", "url"):
            values = [getattr(s, key) for s in self.sources]
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:
                raise ValueError(f"sources share {key} {twice}: give every source its own {key}")
        return self

    @property
    def source(self) -> SourceConfig:
        """The first source (the only one under the ``source:`` shorthand)."""
        return self.sources[0]


def _named(entry: Any, index: int) -> Any:
    """A ``sources:`` entry with its default name, refused if it gives no weight."""
    if not isinstance(entry, dict):
        return entry  # pydantic names the type error
    if "weight" not in entry:
        raise ValueError(f"sources.{index}.weight is missing (url {entry.get('url')!r}): give every source "
                         "in a sources: list a weight > 0, e.g. weight: 1")
    return {"name": f"source{index}", **entry}


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Iterable[str] | Mapping[str, Any] = (),
    env: Mapping[str, str] | None = None,
) -> Config:
    """Read, merge and validate a configuration.

    ``path``: a YAML file, or None for defaults only. ``overrides``: ``"cache.max_bytes=2GB"``
    strings or a ``{"cache.max_bytes": "2GB"}`` mapping, highest precedence. ``env``: the environment
    to read ``EPOCHCACHE_*`` variables from (default ``os.environ``). Raises :class:`ConfigError`.
    """
    data: dict[str, Any] = {}
    file_origin = "defaults"
    base_dir = Path.cwd()
    if path is not None:
        file_origin = str(path)
        base_dir = Path(path).resolve().parent
        data = _read_yaml(Path(path))
    # dotted key -> where its value was written, for errors: the env var's name, the --set flag.
    origins: dict[str, str] = {}
    env_items = [
        (key[len(ENV_PREFIX) :].lower().replace("__", "."), value, f"environment variable {key}")
        for key, value in (os.environ if env is None else env).items()
        if key.startswith(ENV_PREFIX) and "__" in key
    ]
    if isinstance(overrides, Mapping):
        flag_items = [(dotted, value, f"override {dotted}") for dotted, value in overrides.items()]
    else:
        flag_items = [(dotted, value, f"--set {dotted}={_shown(dotted, value)}")
                      for dotted, value in map(_split_override, overrides)]
    for dotted, value, origin in [*env_items, *flag_items]:
        _set_dotted(data, dotted, _parse_scalar(value) if isinstance(value, str) else value, origin)
        origins[dotted] = origin
    try:
        return Config.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as exc:
        shorthand = "source" in data  # the shorthand's entry: name its keys as the user wrote them
        parts = []
        for loc, text in _error_parts(exc):
            if shorthand:
                loc, text = _SHORTHAND.sub("source", loc, count=1), _SHORTHAND.sub("source", text)
            parts.append(f"{_origin_of(loc, text, origins, file_origin)}: {text}")
        raise ConfigError(redact_text("; ".join(parts))) from None


def _origin_of(loc: str, text: str, origins: Mapping[str, str], file_origin: str) -> str:
    """Where the value at ``loc`` came from: the flag or env var that set it (or, for a section-level
    error, the last one that set a key of the section; for a top-level one, the last that set a key
    its ``text`` names), else the YAML file."""
    if loc == "(top level)":
        named = [origin for dotted, origin in origins.items() if dotted in text]
        return named[-1] if named else file_origin
    for dotted in sorted(origins, key=len, reverse=True):
        if loc == dotted or loc.startswith(dotted + "."):
            return origins[dotted]
    below = [origin for dotted, origin in origins.items() if dotted.startswith(loc + ".")]
    return below[-1] if below else file_origin


def format_validation_error(exc: ValidationError) -> str:
    """One line per pydantic error list: ``key.path = value: reason`` joined by ``; ``, secrets masked."""
    return redact_text("; ".join(text for _, text in _error_parts(exc)))


def _error_parts(exc: ValidationError) -> list[tuple[str, str]]:
    """``(dotted key path, "key.path = value: reason")`` for each of pydantic's errors; the errors of
    one value against each branch of a union (``0.5 or 'auto'``) are joined into one."""
    parts: dict[str, str] = {}
    for err in exc.errors(include_url=False):
        # An unknown key is the user's spelling (``max-bytes``), kept whole; others are paths of ours.
        key = err["loc"] if err["type"] == "extra_forbidden" else _key_path(err["loc"])
        loc = ".".join(str(p) for p in key) or "(top level)"
        if err["type"] == "extra_forbidden":
            parts[loc] = f"{loc}: unknown key; {_valid_keys_hint(key)}"
        elif err["type"] == "missing":
            parts[loc] = f"{loc}: required key is missing"
        elif loc in parts:  # another branch of the same union
            parts[loc] += " or " + err["msg"].removeprefix("Input should be ")
        else:
            # A section-level check names its keys in the message; its input is the whole section.
            value = "" if isinstance(err["input"], dict) else f" = {_shown(loc, err['input'])!r}"
            parts[loc] = f"{loc}{value}: {_reason(err, key)}"
    return list(parts.items())


def _key_path(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """``loc`` without pydantic's union branch tags (``constrained-float``, ``literal['auto']``),
    which are never identifiers, unlike every key of the models."""
    return tuple(part for part in loc if isinstance(part, int) or part.isidentifier())


def _reason(err: Any, key: tuple[int | str, ...]) -> str:
    """pydantic's message, with the fix where its own names none (sizes, sections)."""
    if err["type"] == "byte_size":
        return f"not a size: {_SIZE_HINT}"
    if err["type"] == "byte_size_unit":
        return f"{err['msg']}: units are B, KB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2)"
    if err["type"] == "model_type":
        hint = _valid_keys_hint((*key, "")).removeprefix("valid keys here: ")
        return f"must be a section of keys ({hint}), got {type(err['input']).__name__}"
    return str(err["msg"]).removeprefix("Value error, ")


def _shown(dotted: str, value: Any) -> Any:
    """``value`` as an error may echo it: masked under ``storage_options`` (any value there may be a
    credential, whatever its key is called) and for secret-named keys."""
    return MASK if "storage_options" in dotted.split(".") or is_secret_name(dotted.rsplit(".", 1)[-1]) else value


def _valid_keys_hint(loc: tuple[int | str, ...]) -> str:
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        if isinstance(part, int):  # an entry of a list section (sources): its fields are the item's
            continue
        annotation = model.model_fields[str(part)].annotation
        # A tuple[Model, ...] section (sources) lists the keys of its item model.
        annotation = next(iter(get_args(annotation)), annotation) if get_origin(annotation) is tuple else annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return "check the spelling"
        model = annotation
    return "valid keys here: " + ", ".join(sorted(model.model_fields))


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping: YAML forbids it, and PyYAML
    would keep the last silently (a second ``cache:`` section would drop every key of the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # the base class refuses it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is written twice in one section: keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {exc.start}): "
                          "give the YAML config file, saved as UTF-8") from exc
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: builds no Python objects
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"{path}:{line} is not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _split_override(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        # No '=' or no key: nothing that could be a secret's value to mask.
        raise ConfigError(f"--set {item!r} is not of the form section.name=value, e.g. --set cache.max_bytes=20GB")
    return key.strip(), value


def _parse_scalar(raw: str) -> Any:
    """Type a string from the environment or a flag the way YAML would ("8" -> 8, "true" -> True)."""
    try:
        return yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        return raw


def _set_dotted(data: dict[str, Any], dotted: str, value: Any, origin: str) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(redact_text(f"{origin}: {dotted}: {part!r} is a value, not a section"))
        node = child
    node[leaf] = value
