"""A slot's model lifecycle: loaded, validated, guarded by shadow and probation, swapped and watched."""
