"""Augury's shared package: everything the services import (model runtime, trees, verification)."""
