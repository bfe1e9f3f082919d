"""Fills a gap of gcp-storage-emulator that tensorstore (Orbax's array I/O) depends on.

Real GCS returns an object's generation in the `x-goog-generation` header of a media
download; tensorstore keeps it and sends it back as the precondition of its next
read-modify-write (OCDBT manifests). The emulator omits the header, so tensorstore reads
generation 0 and its next conditional write fails with "Malformed StorageGeneration".
`apply()` wraps the download handler to add the header; it must run before the emulator's
server module builds its routing table. (The emulator ignores ifGenerationMatch, which is
fine for a single writer per object, as in our checkpoints.)
"""

from __future__ import annotations


def apply() -> None:
    from gcp_storage_emulator.handlers import objects

    original = objects.download

    def download(request, response, storage, *args, **kwargs):
        original(request, response, storage, *args, **kwargs)
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except Exception:  # not found: the original handler already set 404
            return
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))

    objects.download = download
