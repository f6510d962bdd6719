-- Argo CD health check of a DlqReplay (replay.dlq.dev/v1alpha1): the value of the argocd-cm key
-- resource.customizations.health.replay.dlq.dev_DlqReplay (see argocd-cm-patch.yaml).
-- Plain Lua 5.1 (Argo CD runs gopher-lua); tested by tests/ops_kit.rs, in Lua 5.1, against a
-- status of every phase.
--
--   Pending, Canary, Draining   -> Progressing
--   Done                        -> Healthy
--   Failed, CanaryFailed        -> Degraded
--   Suspended, AwaitingApproval -> Suspended (waits for a person: spec.suspend, an approval)
--   no status yet, or a status older than the spec (observedGeneration < generation)
--                               -> Progressing
local hs = {}
local status = obj.status
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to pick the replay up"
  return hs
end
local generation = obj.metadata and obj.metadata.generation
if generation ~= nil and status.observedGeneration ~= nil and status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local health = {
  Pending = "Progressing",
  Canary = "Progressing",
  Draining = "Progressing",
  Done = "Healthy",
  Failed = "Degraded",
  CanaryFailed = "Degraded",
  Suspended = "Suspended",
  AwaitingApproval = "Suspended",
}
local phase = status.phase
local message = phase
if status.message ~= nil and status.message ~= "" then
  message = phase .. ": " .. status.message
end
local c = status.counts
if c ~= nil then
  message = message .. " (replayed " .. tostring(c.replayed or 0)
    .. ", duplicates " .. tostring(c.duplicates or 0)
    .. ", quarantined " .. tostring(c.quarantined or 0)
    .. ", failed " .. tostring(c.failed or 0) .. ")"
end
hs.status = health[phase]
if hs.status == nil then
  hs.status = "Unknown"
  message = "Unknown phase " .. tostring(phase) .. ": " .. message
end
hs.message = message
return hs
