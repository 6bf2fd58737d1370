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
- Files are probed for what they are before use: `probe` reports the container, whether it is a still image
  (`MediaInfo.is_image`: ffmpeg's image demuxers, `png_pipe`, `image2`, ...) and whether its data ends before its
  header says (`MediaInfo.truncated`: a stream-copy pass to the null muxer reports ffmpeg's "partial file"; a WAV
  whose data chunk is shorter than its header declares). `check_video` / `check_audio_file` turn those into one
  line naming the file: "is an image, not a video", "is truncated: ...", "has no audio stream".
- Writers come in two forms: `write_mp4` / `write_wav` / `write_png_frames` write one artifact now;
  `mp4_writer` / `wav_writer` / `png_frame_writers` return `(path, writer)` items for `io_utils.atomic_write_all`,
  which writes a whole set of outputs and renames them only when every one succeeded.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import struct
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import H3Error
from ..io_utils import atomic_write, atomic_write_all, bytes_writer

FPS = 24
SAMPLE_RATE = 32000
AUDIO_CHANNELS = 2


class MediaError(H3Error):
    """A media file or array cannot be read or written (names the path or value and the rule)."""


def ffmpeg_exe() -> str:
    """Path of the ffmpeg binary bundled with imageio-ffmpeg (`IMAGEIO_FFMPEG_EXE` overrides, as imageio defines)."""
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()


def check_ffmpeg() -> str:
    """The ffmpeg binary, checked before any work: `IMAGEIO_FFMPEG_EXE` (which imageio-ffmpeg takes unchecked)
    must name an executable file; without it the bundled binary must exist. One-line `MediaError` otherwise."""
    env = os.environ.get("IMAGEIO_FFMPEG_EXE")
    try:
        exe = ffmpeg_exe()
    except RuntimeError:
        raise MediaError("no ffmpeg found: reinstall imageio-ffmpeg, or set IMAGEIO_FFMPEG_EXE to an ffmpeg binary") from None
    where = f"IMAGEIO_FFMPEG_EXE={env!r}" if env else f"ffmpeg {exe!r}"
    exe = shutil.which(exe) or exe  # a bare name is looked up on PATH, as subprocess does
    if not os.path.isfile(exe) or not os.access(exe, os.X_OK):
        raise MediaError(f"{where}: not an executable file (h3lab runs ffmpeg for every MP4 and media input)")
    return exe


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


# ffmpeg demuxers of still images (a PNG read by ffmpeg is a one-frame "video" stream at 25 fps).
IMAGE_CONTAINERS = ("image2", "png_pipe", "jpeg_pipe", "bmp_pipe", "webp_pipe", "tiff_pipe", "gif_pipe", "ppm_pipe",
                    "pgm_pipe", "pam_pipe", "qoi_pipe", "jpegls_pipe", "dpx_pipe", "exr_pipe", "psd_pipe", "svg_pipe")


@dataclass(frozen=True)
class MediaInfo:
    path: str
    container: str
    duration: float | None
    streams: tuple[StreamInfo, ...] = field(default_factory=tuple)
    frame_count: int | None = None  # packets of the first video stream (one per frame for every codec we write)
    truncated: str = ""  # why the data ends before the header says ("" when complete)

    @property
    def is_image(self) -> bool:
        """A still image (ffmpeg's image demuxers), not a video, even though ffmpeg lists a video stream."""
        return self.container.split(",")[0] in IMAGE_CONTAINERS or self.container.endswith("_pipe")

    @property
    def kind(self) -> str:
        """'image', 'video' (a video stream, with or without audio), 'audio' or 'other', for messages."""
        if self.is_image:
            return "image"
        if self.video is not None:
            return "video"
        return "audio" if self.audio is not None else "other"

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


def _wav_truncation(p: Path) -> str:
    """For a RIFF/WAVE file: why its data chunk is shorter than the header declares ("" when it is not)."""
    try:
        with open(p, "rb") as f:
            head = f.read(12)
            if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
                return ""
            size = p.stat().st_size
            while True:
                chunk = f.read(8)
                if len(chunk) < 8:
                    return ""
                name, length = chunk[:4], struct.unpack("<I", chunk[4:])[0]
                if name == b"data":
                    held = size - f.tell()
                    if length != 0xFFFFFFFF and held < length:  # 0xFFFFFFFF: a streamed WAV of unknown length
                        return f"its header declares {length:,} bytes of samples, the file holds {held:,}"
                    return ""
                f.seek(length + (length & 1), os.SEEK_CUR)
    except OSError:
        return ""


def _partial_data(p: Path) -> str:
    """ffmpeg's complaint when a stream's packets run past the end of the file ("" when it reads to the end): a
    stream-copy pass of every stream to the null muxer, no decoding."""
    cmd = [ffmpeg_exe(), "-hide_banner", "-nostdin", "-v", "error", "-i", str(p), "-map", "0", "-c", "copy", "-f",
           "null", "-"]
    run = subprocess.run(cmd, capture_output=True)
    text = run.stderr.decode("utf-8", "replace")
    m = re.search(r"stream (\d+), offset (0x[0-9a-f]+): partial file", text)
    if m:
        offset, size = int(m.group(2), 16), p.stat().st_size
        return f"its stream {m.group(1)} packet at byte {offset:,} runs past the end of the file ({size:,} bytes)"
    return ""


def _starts_mp4(p: Path) -> bool:
    """An ISO-BMFF file (MP4/MOV) opens with an `ftyp` box: bytes 4..8."""
    try:
        with open(p, "rb") as f:
            return f.read(8)[4:8] == b"ftyp"
    except OSError:
        return False


def probe(path: str | os.PathLike, count_frames: bool = True) -> MediaInfo:
    """Streams, codecs, sizes, rates and channel counts of a media file, parsed from `ffmpeg -i` (there is no
    ffprobe in imageio-ffmpeg), whether it is a still image, and whether it is truncated (module docstring). With
    `count_frames`, the first video stream's packets are counted by a stream-copy pass to the null muxer (`-c copy
    -f null`), which reads the container without decoding."""
    p = _check_input_path(path)
    proc = subprocess.run([ffmpeg_exe(), "-hide_banner", "-nostdin", "-i", str(p)], capture_output=True)
    text = proc.stderr.decode("utf-8", "replace")
    container = re.search(r"^Input #0, ([^,]+(?:,[^,\s]+)*), from", text, re.M)
    if container is None:
        reason = _last_error_line(proc.stderr)
        if _starts_mp4(p):  # an MP4 (it opens with 'ftyp') that ffmpeg cannot open: cut short, or never finished
            raise MediaError(f"{str(p)!r} is a truncated or unfinished MP4: ffmpeg cannot open it ({reason})")
        raise MediaError(f"{str(p)!r} is not a media file ffmpeg can read ({reason})")
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
    info = MediaInfo(str(p), container.group(1), duration, tuple(streams), frame_count)
    if not streams and _starts_mp4(p):
        info = dataclasses.replace(info, truncated="an MP4 header with no stream index ('moov') after it")
    elif not info.is_image:
        truncated = _wav_truncation(p) if info.container.split(",")[0] == "wav" else _partial_data(p)
        info = dataclasses.replace(info, truncated=truncated)
    return info


def _what(info: MediaInfo) -> str:
    """'a PNG image', 'an MP4/MOV video', 'a WAV audio file', ... for messages."""
    container = info.container.split(",")[0]
    if info.is_image:
        codec = info.video.codec.upper() if info.video is not None else container.removesuffix("_pipe").upper()
        return f"{'an' if codec[:1] in 'AEIOU' else 'a'} {codec} image"
    if info.video is not None:
        return "a video" + (" without sound" if info.audio is None else "")
    if info.audio is not None:
        return f"an audio file ({container})"
    return f"a {container} file with no video or audio stream"


def check_video(path: str | os.PathLike, flag: str, needs_audio: bool = False) -> MediaInfo:
    """Probe a file given as a video (`flag` names the option for messages): it must be complete, a video (not an
    image) with a frame rate, and with an audio stream when `needs_audio`."""
    info = probe(path, count_frames=False)
    where = f"{flag} {str(path)!r}"
    if info.is_image:
        raise MediaError(f"{where}: is {_what(info)}, not a video (use --ref-image for images)")
    if info.truncated:
        raise MediaError(f"{where}: is truncated ({info.truncated}); re-export or re-download it")
    if info.video is None:
        raise MediaError(f"{where}: is {_what(info)}, not a video")
    if not info.video.fps:
        raise MediaError(f"{where}: its video stream reports no frame rate")
    if needs_audio and info.audio is None:
        raise MediaError(
            f"{where}: has no audio stream (use --ref-silent-video, or --ref-video-audio VIDEO AUDIO)"
        )
    return info


def check_audio_file(path: str | os.PathLike, flag: str) -> MediaInfo:
    """Probe a file given for its sound: complete, with an audio stream."""
    info = probe(path, count_frames=False)
    where = f"{flag} {str(path)!r}"
    if info.truncated:
        raise MediaError(f"{where}: is truncated ({info.truncated}); re-export or re-download it")
    if info.audio is None:
        raise MediaError(f"{where}: is {_what(info)}, which has no audio stream")
    return info


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


def _encode_mp4(tmp: str, frames: np.ndarray, fps: float, audio: np.ndarray | None, crf: int,
                target: str = "") -> None:
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
        raise MediaError(f"ffmpeg failed to encode MP4 {target or tmp!r} (exit {code}): {_last_error_line(stderr)}")


def mp4_writer(
    path: str | os.PathLike,
    frames: Any,
    fps: float = FPS,
    audio: Any | None = None,
    crf: int = 18,
) -> tuple[Path, Callable[[str], None]]:
    """`(path, writer)` for `io_utils.atomic_write_all`: the inputs are checked now, the encode runs in `writer`."""
    arr = _check_frames(frames)
    _, h, w, _ = arr.shape
    if h % 2 or w % 2:
        raise MediaError(f"frame size {w}x{h}: H.264 yuv420p needs even width and height (refused, not padded)")
    if not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
        raise MediaError(f"fps={fps!r}: must be a positive finite number")
    pcm = None if audio is None else _check_audio(audio)
    if not isinstance(crf, int) or not 0 <= crf <= 51:
        raise MediaError(f"crf={crf!r}: must be an integer in 0..51")
    return Path(path), lambda tmp: _encode_mp4(tmp, arr, float(fps), pcm, crf, target=str(path))


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
    return atomic_write(*mp4_writer(path, frames, fps, audio, crf))


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


def wav_writer(path: str | os.PathLike, audio: Any, sample_rate: int = SAMPLE_RATE
               ) -> tuple[Path, Callable[[str], None]]:
    """`(path, writer)` for `io_utils.atomic_write_all` (the samples are checked and serialised now)."""
    return Path(path), bytes_writer(wav_bytes(audio, sample_rate))


def write_wav(path: str | os.PathLike, audio: Any, sample_rate: int = SAMPLE_RATE) -> Path:
    """Write `(C, N)` float audio as a float32 WAV, atomically (lossless: reads back bit for bit)."""
    return atomic_write(*wav_writer(path, audio, sample_rate))


def png_frame_writers(directory: str | os.PathLike, frames: Any, prefix: str = "frame_"
                      ) -> list[tuple[Path, Callable[[str], None]]]:
    """`(path, writer)` per frame, `<dir>/<prefix>00000.png`, in order, for `io_utils.atomic_write_all`."""
    from PIL import Image

    arr = _check_frames(frames)
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise MediaError(f"frames directory {str(out)!r} exists and is not a directory")
    if not re.fullmatch(r"[A-Za-z0-9_.-]*", prefix):
        raise MediaError(f"frame prefix {prefix!r}: only letters, digits, '_', '.', '-' are allowed")
    width = max(5, len(str(arr.shape[0] - 1)))
    return [
        (out / f"{prefix}{i:0{width}d}.png", lambda tmp, im=Image.fromarray(frame): im.save(tmp, "PNG"))
        for i, frame in enumerate(arr)  # uint8 (H, W, 3) -> RGB
    ]


def write_png_frames(directory: str | os.PathLike, frames: Any, prefix: str = "frame_") -> list[Path]:
    """Write each frame as `<dir>/<prefix>00000.png` (all written, then all renamed); returns the paths in order."""
    return atomic_write_all(png_frame_writers(directory, frames, prefix))


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
    except UnidentifiedImageError:
        raise MediaError(f"{str(p)!r} is not an image PIL can decode ({_not_an_image(p)})") from None
    except (OSError, SyntaxError, ValueError) as err:  # PIL: "image file is truncated", broken chunks, ...
        text = str(err).split("\n")[0]
        if "truncated" in text:
            raise MediaError(f"{str(p)!r} is a truncated image ({text}); re-export or re-download it") from None
        raise MediaError(f"{str(p)!r} is a damaged image PIL cannot decode ({text})") from None
    return np.asarray(rgb, dtype=np.uint8).copy()


def _not_an_image(p: Path) -> str:
    """What a file PIL cannot identify is instead, per ffmpeg ("it is a video", ...), for messages."""
    try:
        info = probe(p, count_frames=False)
    except MediaError:
        return "neither PIL nor ffmpeg recognise its format"
    if info.is_image or info.video is None and info.audio is None:  # ffmpeg went by the file name alone
        return "its bytes are not an image format PIL knows"
    return f"it is {_what(info)}" + ("; use --ref-video / --ref-silent-video for videos" if info.video else "")


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
    if stream is None or info.is_image:
        raise MediaError(f"{str(p)!r} has no video stream (it is {_what(info)})")
    if info.truncated:
        raise MediaError(f"{str(p)!r} is truncated ({info.truncated}); re-export or re-download it")
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
        raise MediaError(f"{str(p)!r} has no audio stream (it is {_what(info)})")
    if info.truncated:
        raise MediaError(f"{str(p)!r} is truncated ({info.truncated}); re-export or re-download it")
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
