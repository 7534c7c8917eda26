"""How a rank's bytes arrive: the load strategy chain (`chain`) and the strategies it runs, from a peer over NIXL
(`peer`, which orders its `candidate`s with a `selector`), from object storage (`object_storage`) and from a local
seed file (`local_file`)."""
