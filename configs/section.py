"""The base of every config section, and the discriminator of a section with choices."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Discriminator


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, field docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


def choice(key: str, *tags: str) -> Discriminator:
    """The discriminator of a section with choices: the value of `key`, which like any field has a
    default (the first tag) when the section leaves it out. A bad value is one error naming the key."""

    def tag(value: Any) -> Any:
        return value.get(key, tags[0]) if isinstance(value, dict) else getattr(value, key, None)

    expected = " or ".join(repr(t) for t in tags)
    return Discriminator(
        tag, custom_error_type="choice", custom_error_message=f"Input should be {expected}", custom_error_context={"key": key}
    )
