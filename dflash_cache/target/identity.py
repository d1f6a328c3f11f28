"""Is the --target a command is given the model something was made for? A cache's manifest (`train`)
and an export's config.json (`eval`) both record, under "target", the identity of the target they
were made for; this is the one comparison of such a record with a given target, so that both phases
compare the same fields in the same order and refuse another model with the same one-line message,
naming both models and the first field that differs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_cache.errors import UserError
from dflash_cache.store.manifest import TargetIdentity

RECORD_KEY = "target"  # where a manifest and an export's config.json keep the identity
# Fields a given target must match, the most telling first: a refusal names the first that differs
# (the config hash only when none of the sizes tells the two targets apart).
TARGET_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size", "config_hash")
WEIGHTS_FIELD = "weights_fingerprint"


def first_difference(recorded: TargetIdentity, given: TargetIdentity, *, weights: bool = False) -> str | None:
    """The first of TARGET_FIELDS (then, with `weights`, the weights fingerprint) on which the two
    identities differ; None when they name the same model (their names, paths, may differ)."""
    names = (*TARGET_FIELDS, WEIGHTS_FIELD) if weights else TARGET_FIELDS
    return next((name for name in names if getattr(recorded, name) != getattr(given, name)), None)


@dataclass(frozen=True)
class TargetRecord:
    """A record of the target something was made for, as a refusal names it: `where` the record is
    (e.g. "cache manifest"), how it was `made` ("extracted from"), and the `fix` to tell the user."""

    identity: TargetIdentity
    where: str
    made: str
    fix: str

    def refusal(self, field: str, have: Any, given_name: str, want: Any) -> UserError:
        """The one-line error for a `field` of the record that is `have` where --target `given_name`
        has `want` (also for what the record holds beside the identity, like a cache's layer ids)."""
        return UserError(f"{self.where} field {field} is {have!r} ({self.made} target {self.identity.name}), "
                         f"but --target {given_name} has {want!r}; {self.fix}")

    def check(self, given: TargetIdentity, *, weights: bool = False) -> None:
        """Refuse `given` unless it is the recorded model: the architecture (TARGET_FIELDS) and, with
        `weights`, the weights too (a cache's features are those weights' outputs; an export's
        drafter also runs on a fine-tune, which its caller may only warn about)."""
        name = first_difference(self.identity, given, weights=weights)
        if name is not None:
            raise self.refusal(f"{RECORD_KEY}.{name}", getattr(self.identity, name), given.name,
                               getattr(given, name))
