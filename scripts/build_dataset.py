#!/usr/bin/env python
"""Thin wrapper over ``hypersloth-build-dataset`` (same flags; run with --help)."""

from HyperSloth.cli.build_dataset import main

if __name__ == "__main__":
    main()
