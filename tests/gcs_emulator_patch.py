"""Fills two gaps of gcp-storage-emulator that our code depends on.

* tensorstore (Orbax's array I/O): real GCS returns an object's generation in the
  `x-goog-generation` header of a media download; tensorstore keeps it and sends it back as
  the precondition of its next read-modify-write (OCDBT manifests). The emulator omits the
  header, so tensorstore reads generation 0 and its next conditional write fails with
  "Malformed StorageGeneration". The download handler is wrapped to add the header.
* the run lease (runtime/lease.py): it creates its object with ifGenerationMatch=0 and
  renews or takes it over with ifGenerationMatch=<the generation it read>, so that of two
  writers exactly one succeeds. The emulator ignores the precondition; uploads and deletes
  are wrapped to answer 412 (conditionNotMet) as GCS does when it does not hold.

`apply()` must run before the emulator's server module builds its routing table.
"""

from __future__ import annotations

from http import HTTPStatus

_CONDITION_NOT_MET = "At least one of the pre-conditions you specified did not hold."


def apply() -> None:
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    original_download, original_insert, original_delete = objects.download, objects.insert, objects.delete

    def download(request, response, storage, *args, **kwargs):
        original_download(request, response, storage, *args, **kwargs)
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except Exception:  # not found: the original handler already set 404
            return
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))

    def precondition_failed(request, response, storage, object_id) -> bool:
        """Answer 412 when ifGenerationMatch names another generation (0: the object must not exist)."""
        wanted = request.query.get("ifGenerationMatch")
        if not wanted or object_id is None or "upload_id" in request.query:  # resumable: checked at its start
            return False
        try:
            current = str(storage.get_file_obj(request.params["bucket_name"], object_id)["generation"])
        except NotFound:
            current = "0"
        if current == wanted[0]:
            return False
        response.status = HTTPStatus.PRECONDITION_FAILED
        response.json({"error": {"code": 412, "message": _CONDITION_NOT_MET,
                                 "errors": [{"reason": "conditionNotMet", "message": _CONDITION_NOT_MET}]}})
        return True

    def uploaded_name(request):
        if "name" in request.query:
            return request.query["name"][0]
        kind = (request.query.get("uploadType") or [""])[0]
        data = request.data if kind in ("multipart", "resumable") else None
        if kind == "multipart" and isinstance(data, dict):
            return (data.get("meta") or {}).get("name")
        return data.get("name") if isinstance(data, dict) else None

    def insert(request, response, storage, *args, **kwargs):
        if precondition_failed(request, response, storage, uploaded_name(request)):
            return None
        return original_insert(request, response, storage, *args, **kwargs)

    def delete(request, response, storage, *args, **kwargs):
        if precondition_failed(request, response, storage, request.params["object_id"]):
            return None
        return original_delete(request, response, storage, *args, **kwargs)

    objects.download, objects.insert, objects.delete = download, insert, delete
