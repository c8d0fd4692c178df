"""Generated from specs/ by tools/gen_stubs.py; do not edit."""
