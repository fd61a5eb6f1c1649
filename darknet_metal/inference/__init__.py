"""Detection: images read and letterboxed as Darknet does (``image``), ``[yolo]`` outputs
decoded into boxes with NMS (``boxes``), an exported model's decoded outputs made into the
same detections (``decoded``), the ``Detector`` that joins them around a network
(``detector``), pipelined streams of frames (``stream``), video files (``video``), annotated
images (``draw``) and Darknet's JSON output (``detection_json``).

Owns: everything between an image and its detections. May import: ``errors``, ``files``,
``fp32``, ``arguments``, ``cpu`` (the resize loops), ``model`` and ``runtime`` (a stream's
pass ring); it reaches a network only through the protocol ``detector.DetectingNetwork``.
"""
