"""The mutation helpers the tests' workers use (distkit.mutation: one exact piece of a script's
source replaced, for negative controls)."""
from distkit.mutation import mutate, mutated_source  # noqa: F401
