"""The sandbox fleet harness (fleet.py) and its tests; a package so its modules import as tests.sandbox.*."""
