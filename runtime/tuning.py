"""Which schedule variant a launch takes (docs/tuning.md).

A SKU whose launch kind has several schedules (manifest launch metadata ``schedules`` and
``default_schedule``) runs the one the tuning table names for its problem: the manifest's ``tuning`` section, one
table per arch (``sm90``...) and family (the SKU's category), written by ``python -m codegen tune`` on a GPU of
that arch into the family's folder (``codegen/families/<family>/tuning/<arch>.json``). The rule,
in order:

1. the ``schedule`` setting (``SKUFORGE_SCHEDULE``, or ``runtime.config.override(schedule=...)``):
   that schedule for every launch whose kind declares it (measurements, verification);
2. the device arch's table: the entry for the SKU's op, scope and element kinds
   (``quantize/group/bf16/s8``), else for its launch kind, op, scope and element sizes
   (``elementwise:quantize/group/2B/1B``: f16 takes what bf16 measured), at the problem's size
   bucket (:data:`BUCKETS`);
3. otherwise (no table for the arch, no entry, a schedule the SKU lacks): the kind's default.

The choice is made when a launch is prepared, once per problem shape: a repeated call replays the
prepared launch and pays nothing for it.
"""
from __future__ import annotations

from .config import CACHES, settings
from .errors import InvalidProblemError
from .kinds import SIZE

# Size buckets, by elements of the problem's input: (upper bound inclusive, name); the last is open.
BUCKETS = ((1 << 17, "le128k"), (1 << 21, "le2m"), (1 << 25, "le32m"), (None, "gt32m"))


def bucket(elements: int) -> str:
    """The size bucket of a problem of ``elements`` elements."""
    for bound, name in BUCKETS:
        if bound is None or elements <= bound:
            return name
    raise AssertionError("the last bucket is open")


def keys(plan) -> tuple:
    """The table keys of a plan's SKU, most specific first: ``op/scope/element/aux``, then the launch
    kind with the op, scope and element sizes (``elementwise:quantize/group/2B/1B``)."""
    sku = plan.sku
    aux, scope = sku.aux_element or "-", sku.scope or "-"
    sized = f"{SIZE.get(sku.element, 0)}B/{SIZE.get(sku.aux_element, 0) if sku.aux_element else 0}B"
    return f"{sku.op}/{scope}/{sku.element}/{aux}", f"{plan.launch['kind']}:{sku.op}/{scope}/{sized}"


def arch_name(cc: int) -> str:
    return f"sm{cc}"


_CHOICES = CACHES.new()


def choose(plan, elements: int, cc: int) -> tuple:
    """(name, parameters) of the schedule ``plan`` runs for a problem of ``elements`` input elements
    on a device of compute capability ``cc``; (None, {}) for a kind with one way to launch."""
    sched = plan.launch.get("schedules")
    if not sched:
        return None, {}
    forced = settings().schedule
    key = (plan, bucket(elements), cc, forced)
    hit = _CHOICES.get(key)
    if hit is None:
        if forced and forced not in sched:
            _check_forced(plan.registry, forced)
        name = forced if forced in sched else None
        if name is None:
            by_family = plan.registry.tuning.get(arch_name(cc), {})
            table = by_family.get(plan.sku.category, {}).get("choices", {})
            for k in keys(plan):
                name = table.get(k, {}).get(key[1])
                if name in sched:
                    break
            else:
                name = plan.launch["default_schedule"]
        hit = _CHOICES[key] = (name, sched[name])
        if len(_CHOICES) > 4096:
            _CHOICES.clear()
    return hit


def schedule(plan, elements: int, props: dict) -> dict:
    """The parameters of :func:`choose`'s schedule on a device of properties ``props``
    (runtime.device.properties; empty for a kind with one way to launch)."""
    return choose(plan, elements, props.get("cc", 0))[1]


def _check_forced(registry, name: str) -> None:
    """A forced schedule must be one that some kind declares: a typo is an error, not the default."""
    names = sorted({n for e in registry.entries.values() for n in e.launch.get("schedules", ())})
    if name not in names:
        raise InvalidProblemError(f"SKUFORGE_SCHEDULE={name!r} is no schedule of any kernel; the schedules: "
                                  f"{', '.join(names)}")


def forget() -> None:
    """Drop the remembered choices (the settings or the registry changed)."""
    _CHOICES.clear()
