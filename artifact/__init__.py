"""The artifact format, shared by the exporter (which writes it) and the runtime (which reads it).

    base.onnx, draft.onnx   graphs (draft only when a head was exported); model.pt / draft.pt for
                            torch targets
    weights.bin             every weight of both ONNX graphs, once (ONNX external data)
    tokenizer/              tokenizer.json, tokenizer_config.json, chat_template.jinja
    manifest.json           what the runtime needs to check and drive the graphs (manifest.py)

manifest.py reads and writes the manifest and its checksums, directory.py creates the directory
atomically, graphs.py parses a graph's interface as the manifest lists it. Neither export/ nor
runtime/ imports the other for any of it.
"""
