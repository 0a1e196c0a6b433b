"""Model files from peers: a node that lacks a model's file fetches it, content-addressed, from a node that has it.

Pure core: `transfer` (names that may travel, the chunk plan, which holder's version to fetch, resume from a part
file's journal, the checks of each chunk and of the whole file, the free-space check, refusal reasons). Blocking
shell for worker threads: `part` (the temporary file beside the destination and its journal of chunk hashes). The
actor on the bus: `actor` (`FilesActor`: `mesh.files.<node>.held` / `.chunk` answered for files this node's
catalog or a registry entry names, and `.pull`, which fetches one). Wire format: messages/files.py.
"""

from typing import Final

#: The pure cores: no I/O, no clock, no randomness, all of it passed in (`tests/test_import_rules.py` holds
#: them, and everything else, to the import rules of the design).
CORES: Final = frozenset({"transfer"})
#: No `INTERFACES`: nothing of it is used in-process by other actors.
