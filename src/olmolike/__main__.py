"""``python -m olmolike ...`` is the ``olmolike`` command (what ``torchrun -m olmolike`` runs)."""

from olmolike.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
