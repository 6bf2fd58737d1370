"""Media I/O through the ffmpeg that imageio-ffmpeg ships: MP4 out, reference video/audio/images in.

Contract
- ffmpeg is `imageio_ffmpeg.get_ffmpeg_exe()` (no system ffmpeg or ffprobe is needed or used), always run through
  `subprocess` with an argument list, never a shell.
- Raw frames and PCM only ever travel through pipes: `write_mp4` feeds RGB24 frames on ffmpeg's stdin and float32
  PCM on a second `os.pipe()` handed to the child with `pass_fds` (`-i pipe:<fd>`), both written by their own thread
  so neither pipe can stall the other; decoders read raw output from ffmpeg's stdout. No uncompressed temporary
  file is created anywhere.
- Every artifact is written atomically (`h3lab.io_utils.atomic_write`: temp file in the target directory, fsync,
  rename); a failed encode leaves the previous file in place and no temp file behind.
- Shapes: frames are uint8 `(F, H, W, 3)` RGB (numpy or torch); audio is float32 `(2, N)` stereo at 32 kHz in
  [-1, 1] (numpy or torch). Readers return numpy arrays.
- `write_mp4` makes H.264 (libx264, yuv420p, crf 18) + AAC-LC 32 kHz stereo. yuv420p subsamples chroma 2x2, so odd
  widths/heights are **refused** (not padded): every h3lab canvas is a multiple of 32, so an odd frame is a caller bug.
- `read_video(..., target_fps=24)` resamples onto 24 fps exactly as the released pipeline does (facts section 6:
  frame i goes to slot floor(i*24/fps + 0.5), frames are dropped/duplicated whole); `read_audio` always returns
  32 kHz stereo, resampled and (for mono) duplicated by ffmpeg.
- Errors a user can cause (missing file, not media, no stream of the needed kind, odd size, bad array) raise
  `MediaError` (an `H3Error`) with a one-line message naming the path or value and the rule.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import struct
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import H3Error
from ..io_utils import atomic_write

FPS = 24
SAMPLE_RATE = 32000
AUDIO_CHANNELS = 2


class MediaError(H3Error):
    """A media file or array cannot be read or written (names the path or value and the rule)."""


def ffmpeg_exe() -> str:
    """Path of the ffmpeg binary bundled with imageio-ffmpeg (`IMAGEIO_FFMPEG_EXE` overrides, as imageio defines)."""
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()


# ------------------------------------------------------------------------------------------------ array checks
def _as_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, without importing torch here
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _check_frames(frames: Any, what: str = "frames") -> np.ndarray:
    """uint8 (F, H, W, 3) C-contiguous numpy, or MediaError naming the shape/dtype."""
    arr = _as_numpy(frames)
    if arr.dtype != np.uint8:
        raise MediaError(f"{what} dtype {arr.dtype}: must be uint8 RGB")
    if arr.ndim != 4 or arr.shape[-1] != 3 or arr.shape[0] < 1 or arr.shape[1] < 1 or arr.shape[2] < 1:
        raise MediaError(f"{what} shape {tuple(arr.shape)}: must be (frames>=1, height, width, 3)")
    return np.ascontiguousarray(arr)


def _check_audio(audio: Any, what: str = "audio") -> np.ndarray:
    """float32 (2, N) finite numpy in [-1, 1] (values outside are clipped by the encoder, not here), or MediaError."""
    arr = _as_numpy(audio)
    if arr.ndim != 2 or arr.shape[0] != AUDIO_CHANNELS or arr.shape[1] < 1:
        raise MediaError(f"{what} shape {tuple(arr.shape)}: must be (2, samples>=1) stereo")
    if not np.issubdtype(arr.dtype, np.floating):
        raise MediaError(f"{what} dtype {arr.dtype}: must be floating point in [-1, 1]")
    arr = arr.astype(np.float32, copy=False)
    if not np.isfinite(arr).all():
        raise MediaError(f"{what} contains NaN or infinity: samples must be finite")
    return arr


def _check_input_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise MediaError(f"media file {str(p)!r} does not exist")
    if not p.is_file():
        raise MediaError(f"media path {str(p)!r} is not a regular file")
    return p


def _last_error_line(stderr: bytes) -> str:
    lines = [ln.strip() for ln in stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
    return lines[-1] if lines else "no message"


# ------------------------------------------------------------------------------------------------ probe
@dataclass(frozen=True)
class StreamInfo:
    index: int
    kind: str  # "video" | "audio" | other ffmpeg stream type, lower case
    codec: str  # "h264", "aac", "png", ...
    width: int | None = None
    height: int | None = None
    fps: float | None = None
    sample_rate: int | None = None
    channels: int | None = None
    pix_fmt: str | None = None
    rotation: float = 0.0  # display-matrix rotation in degrees; ffmpeg autorotates on decode


@dataclass(frozen=True)
class MediaInfo:
    path: str
    container: str
    duration: float | None
    streams: tuple[StreamInfo, ...] = field(default_factory=tuple)
    frame_count: int | None = None  # packets of the first video stream (one per frame for every codec we write)

    def first(self, kind: str) -> StreamInfo | None:
        return next((s for s in self.streams if s.kind == kind), None)

    @property
    def video(self) -> StreamInfo | None:
        return self.first("video")

    @property
    def audio(self) -> StreamInfo | None:
        return self.first("audio")


_STREAM_RE = re.compile(r"^\s*Stream #\d+:(\d+)(?:\[[^\]]*\])?(?:\([^)]*\))?: (\w+): (.*)$")
_PIX_FMT = r"(?:^|[ ,])((?:yuvj?|yuva|rgb|bgr|gbr|gray|nv|pal|argb|abgr|rgba|bgra)[a-z0-9]*)(?=[(, ]|$)"
_CHANNELS = {"mono": 1, "stereo": 2, "2.1": 3, "quad": 4, "4.0": 4, "5.0": 5, "5.1": 6, "6.1": 7, "7.1": 8}


def _parse_stream(index: int, kind: str, rest: str) -> StreamInfo:
    kind = kind.lower()
    codec = rest.split(",")[0].split()[0] if rest else "unknown"
    if kind == "video":
        size = re.search(r"(?:^|[ ,])(\d{1,6})x(\d{1,6})(?=[ ,\[]|$)", rest)
        fps = re.search(r"([\d.]+)(k?) fps", rest) or re.search(r"([\d.]+)(k?) tbr", rest)
        pix = re.search(_PIX_FMT, rest)
        rate = None
        if fps:
            rate = float(fps.group(1)) * (1000.0 if fps.group(2) else 1.0)
        return StreamInfo(
            index,
            kind,
            codec,
            width=int(size.group(1)) if size else None,
            height=int(size.group(2)) if size else None,
            fps=rate,
            pix_fmt=pix.group(1) if pix else None,
        )
    if kind == "audio":
        rate = re.search(r"(\d+) Hz", rest)
        layout = re.search(r"Hz, ([^,]+)", rest)
        channels = None
        if layout:
            name = layout.group(1).strip()
            channels = _CHANNELS.get(name.split("(")[0])
            if channels is None:
                m = re.match(r"(\d+) channels", name)
                channels = int(m.group(1)) if m else None
        return StreamInfo(index, kind, codec, sample_rate=int(rate.group(1)) if rate else None, channels=channels)
    return StreamInfo(index, kind, codec)


def probe(path: str | os.PathLike, count_frames: bool = True) -> MediaInfo:
    """Streams, codecs, sizes, rates and channel counts of a media file, parsed from `ffmpeg -i` (there is no
    ffprobe in imageio-ffmpeg). With `count_frames`, the first video stream's packets are counted by a stream-copy
    pass to the null muxer (`-c copy -f null`), which reads the container without decoding."""
    p = _check_input_path(path)
    proc = subprocess.run([ffmpeg_exe(), "-hide_banner", "-nostdin", "-i", str(p)], capture_output=True)
    text = proc.stderr.decode("utf-8", "replace")
    container = re.search(r"^Input #0, ([^,]+(?:,[^,\s]+)*), from", text, re.M)
    if container is None:
        raise MediaError(f"{str(p)!r} is not a media file ffmpeg can read ({_last_error_line(proc.stderr)})")
    dur = re.search(r"Duration: (\d+):(\d+):(\d+(?:\.\d+)?)", text)
    duration = int(dur.group(1)) * 3600 + int(dur.group(2)) * 60 + float(dur.group(3)) if dur else None
    streams: list[StreamInfo] = []
    for line in text.splitlines():
        m = _STREAM_RE.match(line)
        if m:
            streams.append(_parse_stream(int(m.group(1)), m.group(2), m.group(3)))
            continue
        rot = re.search(r"rotation of (-?[\d.]+) degrees", line)
        if rot and streams and streams[-1].kind == "video":
            streams[-1] = dataclasses.replace(streams[-1], rotation=float(rot.group(1)))
    frame_count = None
    if count_frames and any(s.kind == "video" for s in streams):
        cmd = [ffmpeg_exe(), "-hide_banner", "-nostdin", "-i", str(p), "-map", "0:v:0", "-c", "copy", "-f", "null", "-"]
        run = subprocess.run(cmd, capture_output=True)
        counts = re.findall(r"frame=\s*(\d+)", run.stderr.decode("utf-8", "replace"))
        frame_count = int(counts[-1]) if counts else None
    return MediaInfo(str(p), container.group(1), duration, tuple(streams), frame_count)


# ------------------------------------------------------------------------------------------------ writers
def _feed(fd_or_file: Any, data: memoryview, errors: list[BaseException]) -> None:
    """Write all of `data` to a pipe and close it; a broken pipe means ffmpeg died, which its exit code reports."""
    try:
        if isinstance(fd_or_file, int):
            with os.fdopen(fd_or_file, "wb", closefd=True) as f:
                f.write(data)
        else:
            try:
                fd_or_file.write(data)
            finally:
                fd_or_file.close()
    except BrokenPipeError:
        pass
    except BaseException as err:  # noqa: BLE001 - re-raised by the caller after join
        errors.append(err)


def _encode_mp4(tmp: str, frames: np.ndarray, fps: float, audio: np.ndarray | None, crf: int) -> None:
    f, h, w, _ = frames.shape
    cmd = [ffmpeg_exe(), "-hide_banner", "-nostdin", "-loglevel", "error", "-y"]
    # Input 0: raw RGB24 frames on stdin.
    cmd += ["-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{w}x{h}", "-framerate", repr(float(fps)), "-i", "pipe:0"]
    read_fd = write_fd = None
    if audio is not None:
        # Input 1: interleaved float32 stereo PCM on a second pipe, inherited by the child under the same number.
        read_fd, write_fd = os.pipe()
        cmd += ["-f", "f32le", "-ar", str(SAMPLE_RATE), "-ac", str(AUDIO_CHANNELS), "-i", f"pipe:{read_fd}"]
    cmd += ["-map", "0:v:0"]
    cmd += ["-c:v", "libx264", "-pix_fmt", "yuv420p", "-crf", str(crf), "-preset", "medium"]
    if audio is not None:
        cmd += ["-map", "1:a:0", "-c:a", "aac", "-b:a", "192k", "-ar", str(SAMPLE_RATE), "-ac", str(AUDIO_CHANNELS)]
    cmd += ["-movflags", "+faststart", "-f", "mp4", tmp]
    errors: list[BaseException] = []
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            pass_fds=(read_fd,) if read_fd is not None else (),
        )
    except BaseException:
        for fd in (read_fd, write_fd):
            if fd is not None:
                os.close(fd)
        raise
    if read_fd is not None:
        os.close(read_fd)  # the child holds its copy; ours would keep the pipe open forever
    threads = [threading.Thread(target=_feed, args=(proc.stdin, memoryview(frames).cast("B"), errors))]
    if audio is not None:
        # (2, N) planar -> (N, 2) interleaved little-endian float32, as f32le expects.
        pcm = np.ascontiguousarray(audio.T, dtype="<f4")
        threads.append(threading.Thread(target=_feed, args=(write_fd, memoryview(pcm).cast("B"), errors)))
    for t in threads:
        t.start()
    stderr = proc.stderr.read()
    for t in threads:
        t.join()
    proc.stderr.close()
    code = proc.wait()
    if errors:
        raise errors[0]
    if code != 0:
        raise MediaError(f"ffmpeg failed to encode MP4 {tmp!r} (exit {code}): {_last_error_line(stderr)}")


def write_mp4(
    path: str | os.PathLike,
    frames: Any,
    fps: float = FPS,
    audio: Any | None = None,
    crf: int = 18,
) -> Path:
    """Encode uint8 `(F, H, W, 3)` frames (+ optional float32 `(2, N)` 32 kHz audio) to an H.264/AAC MP4, atomically.

    Odd H or W are refused (yuv420p needs even dimensions). Audio longer or shorter than the video is kept whole
    (the audio VAE decodes whole 800-sample hops, e.g. 5.175 s of audio against 5.167 s of video at 124 frames)."""
    arr = _check_frames(frames)
    _, h, w, _ = arr.shape
    if h % 2 or w % 2:
        raise MediaError(f"frame size {w}x{h}: H.264 yuv420p needs even width and height (refused, not padded)")
    if not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
        raise MediaError(f"fps={fps!r}: must be a positive finite number")
    pcm = None if audio is None else _check_audio(audio)
    if not isinstance(crf, int) or not 0 <= crf <= 51:
        raise MediaError(f"crf={crf!r}: must be an integer in 0..51")
    return atomic_write(path, lambda tmp: _encode_mp4(tmp, arr, float(fps), pcm, crf))


def wav_bytes(audio: Any, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A RIFF/WAVE file (IEEE float32, format tag 3) holding `audio` `(C, N)` exactly, sample for sample."""
    arr = _as_numpy(audio)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[0] > 8 or arr.shape[1] < 1:
        raise MediaError(f"audio shape {tuple(arr.shape)}: must be (channels 1..8, samples>=1)")
    if not np.issubdtype(arr.dtype, np.floating) or not np.isfinite(arr).all():
        raise MediaError(f"audio dtype {arr.dtype}: must be finite floating point samples")
    if not isinstance(sample_rate, int) or sample_rate <= 0:
        raise MediaError(f"sample_rate={sample_rate!r}: must be a positive integer")
    channels, n = arr.shape
    data = np.ascontiguousarray(arr.T, dtype="<f4").tobytes()
    block = channels * 4
    fmt = struct.pack("<HHIIHH", 3, channels, sample_rate, sample_rate * block, block, 32)
    fact = struct.pack("<I", n)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"fact" + struct.pack("<I", 4) + fact
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def write_wav(path: str | os.PathLike, audio: Any, sample_rate: int = SAMPLE_RATE) -> Path:
    """Write `(C, N)` float audio as a float32 WAV, atomically (lossless: reads back bit for bit)."""
    data = wav_bytes(audio, sample_rate)

    def writer(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    return atomic_write(path, writer)


def write_png_frames(directory: str | os.PathLike, frames: Any, prefix: str = "frame_") -> list[Path]:
    """Write each frame as `<dir>/<prefix>00000.png` (atomically, one by one); returns the paths in order."""
    from PIL import Image

    arr = _check_frames(frames)
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise MediaError(f"frames directory {str(out)!r} exists and is not a directory")
    if not re.fullmatch(r"[A-Za-z0-9_.-]*", prefix):
        raise MediaError(f"frame prefix {prefix!r}: only letters, digits, '_', '.', '-' are allowed")
    out.mkdir(parents=True, exist_ok=True)
    width = max(5, len(str(arr.shape[0] - 1)))
    paths = []
    for i, frame in enumerate(arr):
        image = Image.fromarray(frame)  # uint8 (H, W, 3) -> RGB
        paths.append(atomic_write(out / f"{prefix}{i:0{width}d}.png", lambda tmp, im=image: im.save(tmp, "PNG")))
    return paths


# ------------------------------------------------------------------------------------------------ readers
def read_image(path: str | os.PathLike) -> np.ndarray:
    """Decode an image file to uint8 `(H, W, 3)` RGB with PIL: EXIF orientation applied (as diffusers' `load_image`
    does), palette/grey/alpha converted to RGB (alpha dropped)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    p = _check_input_path(path)
    try:
        with Image.open(p) as image:
            image = ImageOps.exif_transpose(image)
            rgb = image.convert("RGB")
            rgb.load()
    except (UnidentifiedImageError, OSError) as err:
        raise MediaError(f"{str(p)!r} is not an image PIL can decode ({err})") from None
    return np.asarray(rgb, dtype=np.uint8).copy()


def resample_frame_indices(num_frames: int, fps: float, target_fps: float = FPS) -> np.ndarray:
    """Source index of every output frame when `num_frames` frames at `fps` are put on a `target_fps` grid the way
    the released pipeline does: frame i owns the slots from floor(i*target/fps + 0.5) up to the next frame's slot,
    and the last one up to floor(num_frames*target/fps + 0.5). Identity when fps == target_fps."""
    if not (math.isfinite(fps) and fps > 0):
        raise MediaError(f"frame rate {fps!r}: must be a positive finite number")
    if fps == target_fps:
        return np.arange(num_frames)
    scale = target_fps / fps
    slots = np.floor(np.arange(num_frames) * scale + 0.5).astype(np.int64)
    repeats = np.diff(slots, append=math.floor(num_frames * scale + 0.5))
    return np.repeat(np.arange(num_frames), repeats)


def read_video(
    path: str | os.PathLike,
    max_frames: int | None = None,
    target_fps: float | None = None,
) -> tuple[np.ndarray, float]:
    """Decode the first video stream to uint8 `(F, H, W, 3)` RGB and its frame rate.

    `max_frames` bounds what is decoded (before resampling: at most `max_frames` source frames). With `target_fps`
    the frames are put on that grid (`resample_frame_indices`) and the returned rate is `target_fps`."""
    if max_frames is not None and (not isinstance(max_frames, int) or max_frames < 1):
        raise MediaError(f"max_frames={max_frames!r}: must be a positive integer or None")
    p = _check_input_path(path)
    info = probe(p, count_frames=False)
    stream = info.video
    if stream is None:
        raise MediaError(f"{str(p)!r} has no video stream")
    if not stream.width or not stream.height:
        raise MediaError(f"{str(p)!r}: cannot read the video frame size from ffmpeg's stream description")
    height, width = stream.height, stream.width
    if round(stream.rotation / 90.0) % 2:  # ffmpeg autorotates a quarter-turned stream on decode
        height, width = width, height
    fps = stream.fps
    if not fps:
        raise MediaError(f"{str(p)!r}: the video stream reports no frame rate")
    cmd = [ffmpeg_exe(), "-hide_banner", "-nostdin", "-loglevel", "error", "-i", str(p), "-map", "0:v:0"]
    if max_frames is not None:
        cmd += ["-frames:v", str(max_frames)]
    # -vsync passthrough (fps_mode): one output frame per decoded frame, no duplication by the muxer.
    cmd += ["-fps_mode", "passthrough", "-f", "rawvideo", "-pix_fmt", "rgb24", "pipe:1"]
    proc = subprocess.run(cmd, capture_output=True)
    if proc.returncode != 0:
        raise MediaError(f"ffmpeg could not decode video {str(p)!r}: {_last_error_line(proc.stderr)}")
    frame_bytes = width * height * 3
    n = len(proc.stdout) // frame_bytes
    if n < 1 or len(proc.stdout) % frame_bytes:
        raise MediaError(
            f"{str(p)!r}: decoded {len(proc.stdout)} bytes, not a whole number (>=1) of "
            f"{width}x{height} RGB frames (variable-size stream?)"
        )
    frames = np.frombuffer(proc.stdout, dtype=np.uint8).reshape(n, height, width, 3).copy()
    if target_fps is not None:
        frames = frames[resample_frame_indices(n, fps, target_fps)]
        fps = float(target_fps)
    return frames, float(fps)


def read_audio(path: str | os.PathLike, max_seconds: float | None = None) -> np.ndarray:
    """Decode the first audio stream of a file (audio or video) to float32 `(2, N)` at 32 kHz: ffmpeg resamples
    (swresample); mono is copied unchanged to both channels; more than two channels are downmixed by ffmpeg.
    `max_seconds` bounds the decode."""
    if max_seconds is not None and not (isinstance(max_seconds, (int, float)) and max_seconds > 0):
        raise MediaError(f"max_seconds={max_seconds!r}: must be a positive number or None")
    p = _check_input_path(path)
    info = probe(p, count_frames=False)
    if info.audio is None:
        raise MediaError(f"{str(p)!r} has no audio stream")
    cmd = [ffmpeg_exe(), "-hide_banner", "-nostdin", "-loglevel", "error", "-i", str(p), "-map", "0:a:0", "-vn"]
    if max_seconds is not None:
        cmd += ["-t", repr(float(max_seconds))]
    # Mono is decoded as mono and duplicated here: ffmpeg's own mono->stereo upmix scales the samples.
    channels = 1 if info.audio.channels == 1 else AUDIO_CHANNELS
    cmd += ["-f", "f32le", "-acodec", "pcm_f32le", "-ar", str(SAMPLE_RATE), "-ac", str(channels), "pipe:1"]
    proc = subprocess.run(cmd, capture_output=True)
    if proc.returncode != 0:
        raise MediaError(f"ffmpeg could not decode audio {str(p)!r}: {_last_error_line(proc.stderr)}")
    pcm = np.frombuffer(proc.stdout, dtype="<f4")
    if pcm.size < channels or pcm.size % channels:
        raise MediaError(f"{str(p)!r}: the audio stream decoded to no whole samples")
    pcm = pcm.reshape(-1, channels).T
    if channels == 1:
        pcm = np.repeat(pcm, AUDIO_CHANNELS, axis=0)
    return np.ascontiguousarray(pcm, dtype=np.float32)
