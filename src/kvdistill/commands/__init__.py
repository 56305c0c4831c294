"""The CLI commands: one recipe module per `kvdistill COMMAND`, each with an options dataclass and `main(argv)`.

A command wires components (`cache`, `align`, `losses`, `data`, `fusion`, `teachers`, `evaluate`)
and the trainer (`kvdistill.train`); no component imports a command (checked by `lint-imports`).
"""
